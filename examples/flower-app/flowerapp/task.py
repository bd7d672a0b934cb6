"""The model, the data and the local training loop: what any Flower PyTorch quickstart has.

The data are synthetic and non-IID on purpose: every client sees its own feature shift
and a skewed label mix (client drift is what SCAFFOLD corrects), drawn from the
partition id so every node builds its data offline and deterministically.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedge.strategies.client import TrainRound

NUM_FEATURES, NUM_CLASSES = 16, 4


class Net(nn.Module):
    """A small MLP classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(NUM_FEATURES, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.layers(x)


def load_data(
    partition_id: int, num_partitions: int, n: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """This client's examples: shared class centres, a client-specific shift, skewed labels."""
    centres = np.random.default_rng(1234).normal(size=(NUM_CLASSES, NUM_FEATURES)) * 2.0
    rng = np.random.default_rng([partition_id, num_partitions])
    mix = rng.dirichlet(np.full(NUM_CLASSES, 0.5))
    labels = rng.choice(NUM_CLASSES, size=n, p=mix)
    shift = rng.normal(size=NUM_FEATURES) * 0.5
    x = centres[labels] + shift + rng.normal(size=(n, NUM_FEATURES))
    return torch.tensor(x, dtype=torch.float32), torch.tensor(labels, dtype=torch.int64)


def train(
    net: Net, fl: TrainRound, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float
) -> float:
    """Plain SGD on random mini-batches, with the fedge hooks (no-ops under Flower's FedAvg)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(fl.server_round)
    total = 0.0
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=generator)
        optimizer.zero_grad()
        loss = criterion(net(x[idx]), y[idx])
        (loss + fl.loss_term()).backward()
        fl.correct_gradients()
        optimizer.step()
        total += float(loss.detach())
    return total / steps


def evaluate(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Loss and accuracy."""
    with torch.no_grad():
        logits = net(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    return loss, accuracy
