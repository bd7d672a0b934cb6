"""The model, the data and the local loop: what any Flower PyTorch quickstart has."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

NUM_FEATURES, NUM_CLASSES = 16, 4


def Net() -> nn.Module:
    """A small MLP classifier."""
    return nn.Sequential(nn.Linear(NUM_FEATURES, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES))


def load_data(
    partition_id: int, num_partitions: int, n: int = 256
) -> torch.utils.data.TensorDataset:
    """This client's examples: shared class centres, a client-specific shift, skewed labels."""
    centres = np.random.default_rng(1234).normal(size=(NUM_CLASSES, NUM_FEATURES)) * 2.0
    rng = np.random.default_rng([partition_id, num_partitions])
    labels = rng.choice(NUM_CLASSES, size=n, p=rng.dirichlet(np.full(NUM_CLASSES, 0.5)))
    x = centres[labels] + rng.normal(size=NUM_FEATURES) * 0.5 + rng.normal(size=(n, NUM_FEATURES))
    return torch.utils.data.TensorDataset(
        torch.tensor(x, dtype=torch.float32), torch.tensor(labels)
    )


def train(model: nn.Module, optimizer: torch.optim.Optimizer, loader, epochs: int) -> float:  # type: ignore[no-untyped-def]
    """Plain mini-batch training; returns the mean loss."""
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    return sum(losses) / max(len(losses), 1)
