"""What both sides do with the language model: the training config, the cached base model + adapter, held-out evaluation."""
