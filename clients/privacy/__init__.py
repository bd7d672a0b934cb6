"""Client half of differential privacy: the distributed-DP mod and DP-SGD with Opacus."""
