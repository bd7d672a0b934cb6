"""Flower ServerApp: round loop, evaluation, checkpoints, secure-aggregation and privacy server side."""
