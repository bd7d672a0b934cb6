"""Flower ClientApp: LoRA trainer, per-worker model cache, secure-aggregation and DP client side."""
