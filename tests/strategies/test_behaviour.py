"""Behaviour on a heterogeneous least-squares federation, as the SCAFFOLD and FedProx papers report."""

from __future__ import annotations

import numpy as np

from fedge.simulations.synthetic import make_clients, optimum_loss, run_federation
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.fedprox import FedProx
from fedge.strategies.scaffold import Scaffold


def _rounds_to(history: list[float], target: float) -> float:
    """First round (1-based) whose loss is at or below target; inf when never."""
    return next((i + 1 for i, v in enumerate(history) if v <= target), float("inf"))


def test_scaffold_reaches_target_in_fewer_rounds_than_fedavg() -> None:
    """10 strongly heterogeneous clients, 5 per round, 10 local SGD steps: client drift stalls FedAvg."""
    clients = make_clients(10, 8, heterogeneity=2.0, seed=0)
    target = optimum_loss(clients) + 0.05
    fedavg = run_federation(
        FedAvg(), clients, rounds=30, local_steps=10, lr=0.02, per_round=5, seed=1
    )
    scaffold = run_federation(
        Scaffold(), clients, rounds=30, local_steps=10, lr=0.02, per_round=5, seed=1
    )
    assert _rounds_to(scaffold, target) < _rounds_to(fedavg, target)
    assert _rounds_to(scaffold, target) <= 20


def test_fedprox_beats_fedavg_with_90_percent_stragglers() -> None:
    """90% of sampled clients do 1 of 10 steps: FedAvg drops them, FedProx (mu=0.5) averages them in."""
    clients = make_clients(10, 8, heterogeneity=2.0, seed=0)
    opt = optimum_loss(clients)
    kwargs = dict(
        rounds=30,
        local_steps=10,
        lr=0.02,
        per_round=5,
        straggler_fraction=0.9,
        straggler_steps=1,
        seed=1,
    )
    fedavg = run_federation(FedAvg(), clients, **kwargs)  # type: ignore[arg-type]
    fedprox = run_federation(FedProx(proximal_mu=0.5), clients, **kwargs)  # type: ignore[arg-type]
    excess_avg = float(np.mean(np.array(fedavg[-10:]) - opt))
    excess_prox = float(np.mean(np.array(fedprox[-10:]) - opt))
    assert excess_prox < 0.5 * excess_avg
