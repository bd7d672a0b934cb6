"""A small federated least-squares problem for behaviour tests of the strategies.

Runs the real strategy and trainer code.

Each client i owns (A_i, b_i) with strongly different optima; the global objective
is the mean of the client losses 0.5/n_i * ||A_i w - b_i||^2. A round samples
clients, runs :func:`fedge.clients.trainer.run_local_steps` with the strategy's hook and
plain SGD, builds contributions, sums them, and calls ``finalize``: the same path
the Flower apps take, minus transport.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedge import keys
from fedge.clients.state import MemoryStore
from fedge.clients.trainer import run_local_steps
from fedge.strategies.base import (
    Arrays,
    ClientResult,
    ConfigValue,
    GlobalState,
    Strategy,
    build_contribution,
    sum_contributions,
)


@dataclass(frozen=True)
class LeastSquaresClient:
    """One client's data: design matrix A (n x d) and targets b (n)."""

    a: np.ndarray
    b: np.ndarray

    def loss(self, w: np.ndarray) -> float:
        """0.5 * mean squared residual."""
        r = self.a @ w - self.b
        return float(0.5 * np.mean(r**2))


def make_clients(
    num_clients: int, dim: int, heterogeneity: float, seed: int
) -> list[LeastSquaresClient]:
    """Clients whose optima spread by ``heterogeneity`` and whose features are scaled differently."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(size=dim)
    clients = []
    for _ in range(num_clients):
        scale = np.exp(
            rng.uniform(-1.0, 1.0, size=dim)
        )  # per-client feature scales: skewed curvature
        a = rng.normal(size=(40, dim)) * scale
        w_star = shared + heterogeneity * rng.normal(size=dim)
        clients.append(LeastSquaresClient(a, a @ w_star + 0.01 * rng.normal(size=40)))
    return clients


def global_loss(clients: list[LeastSquaresClient], w: np.ndarray) -> float:
    """Mean of the client losses."""
    return float(np.mean([c.loss(w) for c in clients]))


def optimum_loss(clients: list[LeastSquaresClient]) -> float:
    """The global objective's minimum (solved exactly)."""
    h = sum(c.a.T @ c.a / len(c.b) for c in clients)
    g = sum(c.a.T @ c.b / len(c.b) for c in clients)
    return global_loss(clients, np.linalg.solve(h, g))


def run_federation(
    strategy: Strategy,
    clients: list[LeastSquaresClient],
    rounds: int,
    local_steps: int,
    lr: float,
    per_round: int,
    straggler_fraction: float = 0.0,
    straggler_steps: int = 1,
    seed: int = 0,
    combine: Callable[[list[Arrays]], Arrays] = sum_contributions,
    tamper: Callable[[int, Arrays], Arrays] | None = None,
) -> list[float]:
    """Run ``rounds`` rounds; return the global loss after each one.

    ``combine`` turns the round's contributions into their sum (a robust rule may stand
    in); ``tamper(client, contribution)`` lets a test play a malicious client.
    """
    dim = clients[0].a.shape[1]
    rng = np.random.default_rng(seed)
    adapter = {"w": np.zeros(dim, dtype=np.float32)}
    state = GlobalState(adapter, strategy.init_extras(adapter))
    stores = [MemoryStore() for _ in clients]
    history = []
    for r in range(1, rounds + 1):
        config = {**strategy.client_config(r), keys.CFG_SERVER_ROUND: r}
        payload = strategy.client_payload(state)
        contributions = []
        for i in sorted(rng.choice(len(clients), size=per_round, replace=False)):
            straggler = rng.random() < straggler_fraction
            steps = straggler_steps if straggler else local_steps
            contribution = _local(
                strategy, clients[i], state, config, payload, stores[i], steps, local_steps, lr, r
            )
            contributions.append(tamper(int(i), contribution) if tamper else contribution)
        summed = combine(contributions)
        if summed[keys.KEY_WEIGHT][0] > 0:  # a round where every sampled client was dropped fails
            state = strategy.finalize(state, summed, population=len(clients))
        history.append(global_loss(clients, state.adapter["w"].astype(np.float64)))
    return history


def _local(
    strategy: Strategy,
    client: LeastSquaresClient,
    state: GlobalState,
    config: dict[str, ConfigValue],
    payload: Arrays,
    store: MemoryStore,
    steps: int,
    full_steps: int,
    lr: float,
    server_round: int,
) -> Arrays:
    """One client's round: SGD with the strategy hook, then its contribution."""
    w = torch.nn.Parameter(torch.from_numpy(state.adapter["w"].copy()))
    trainable = {"w": w}
    a = torch.from_numpy(client.a.astype(np.float32))
    b = torch.from_numpy(client.b.astype(np.float32))
    hook = strategy.client_hook(config, {"w": torch.from_numpy(state.adapter["w"])}, payload, store)
    optimizer = torch.optim.SGD([w], lr=lr)
    run_local_steps(trainable, lambda _s: 0.5 * ((a @ w - b) ** 2).mean(), steps, optimizer, hook)
    delta = {"w": w.detach().numpy() - state.adapter["w"]}
    extras, new_state = hook.finish(delta, steps, lr)
    result = ClientResult(
        delta, num_examples=len(client.b), completed=steps / full_steps, extras=extras
    )
    contribution = build_contribution(result, strategy.weighting, strategy.accepts_partial_work)
    if new_state is not None and contribution[keys.KEY_COUNT][0] > 0:
        store.save(server_round, new_state)
    return contribution
