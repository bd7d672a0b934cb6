"""Server half of differential privacy: clipping, noise, DP aggregators and the budget."""
