"""The round loop's steps, each alone: what counts toward min-train-nodes, and sampling."""

from __future__ import annotations

import numpy as np

from server.loop import next_state, updates_in
from strategies.base import ClientResult, GlobalState, build_contribution, sum_contributions
from strategies.fedavg import FedAvg
from strategies.scaffold import Scaffold

ADAPTER = {"a.lora_B": np.zeros(3, np.float32)}


def _round(strategy: FedAvg, completed: list[float]) -> dict[str, np.ndarray]:
    """The sum of one round's contributions: each client moved the adapter by +1, 10 examples."""
    state = GlobalState(ADAPTER, strategy.init_extras(ADAPTER), 0)
    contributions = []
    for done in completed:
        extras = {k: np.ones_like(v) for k, v in state.extras.items()}
        result = ClientResult({"a.lora_B": np.ones(3, np.float32)}, 10, done, extras)
        contributions.append(build_contribution(result, "examples", strategy.accepts_partial_work))
    return sum_contributions(contributions)


def test_dropped_straggler_replies_count_toward_no_minimum() -> None:
    """Three valid replies, two of them FedAvg stragglers dropped to zeros (meta/count 0): one
    update. With min-train-nodes 2 the round is ``empty`` and the adapter stays; on main the
    three replies counted and one client's update became the global adapter (its delta in the
    clear: min-train-nodes exists so that no aggregate is one client's)."""
    for strategy in (FedAvg(), Scaffold()):
        summed = _round(strategy, [1.0, 0.25, 0.25])
        state = GlobalState(ADAPTER, strategy.init_extras(ADAPTER), 0)
        assert updates_in(summed) == 1
        kept, status = next_state(strategy, state, summed, population=3, min_updates=2)
        assert status == "empty" and kept is state
        moved, status = next_state(strategy, state, summed, population=3, min_updates=1)
        assert status == "ok"
        np.testing.assert_allclose(moved.adapter["a.lora_B"], 1.0)


def test_fedprox_partial_work_is_an_update() -> None:
    """FedProx keeps a straggler's partial work: three replies, three updates, the round is ok."""
    from strategies.fedprox import FedProx

    strategy = FedProx()
    summed = _round(strategy, [1.0, 0.25, 0.25])
    state = GlobalState(ADAPTER, {}, 0)
    assert updates_in(summed) == 3
    assert next_state(strategy, state, summed, population=3, min_updates=3)[1] == "ok"
