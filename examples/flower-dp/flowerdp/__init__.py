"""A Flower quickstart app trained with differential privacy: central, distributed, or DP-SGD."""
