"""A Flower quickstart app (PyTorch MLP, synthetic data) that runs Flower's or fedge's strategies."""
