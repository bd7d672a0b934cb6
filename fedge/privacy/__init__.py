"""The DP mechanism both sides apply: clipping, Gaussian noise, FFA-LoRA freezing and their wire keys."""
