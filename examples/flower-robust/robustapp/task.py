"""The model, the data and the local loop: a Flower PyTorch quickstart's (no fedge code)."""

import numpy as np
import torch
from torch import nn

FEATURES, CLASSES = 16, 4


def make_net() -> nn.Module:
    """A small MLP classifier."""
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def load_data(partition: int, partitions: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-IID: Dirichlet(0.3) label mix and a feature shift per client, from the partition id."""
    centres = np.random.default_rng(1234).normal(size=(CLASSES, FEATURES)) * 2.0
    rng = np.random.default_rng([partition, partitions])
    labels = rng.choice(CLASSES, size=n, p=rng.dirichlet(np.full(CLASSES, 0.3)))
    x = centres[labels] + rng.normal(size=FEATURES) * 0.5 + rng.normal(size=(n, FEATURES))
    return torch.tensor(x, dtype=torch.float32), torch.tensor(labels)


def train(net: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> None:
    """Plain SGD on random mini-batches."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        optimizer.step()
