"""SCAFFOLD under fedge's SecAgg+ in a Flower quickstart app (PyTorch MLP, synthetic data)."""
