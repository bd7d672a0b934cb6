"""fedge: federated LoRA fine-tuning on Flower and edge-cloud speculative decoding."""

__version__ = "0.1.0"
