"""The round loop's steps, each alone: what counts toward min-train-nodes, and sampling."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from server.aggregation import AggregateResult
from server.budget import NoBudget
from server.loop import aggregate_and_account, next_state, updates_in
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


def test_an_out_of_bounds_secagg_sum_keeps_the_global_model_and_the_run_goes_on() -> None:
    """An aggregate the SecAgg+ bound rejects (``out_of_bounds``): the round's row says
    ``out-of-bounds``, the adapter and extras stay, the round counter moves on, no client's
    state is marked committed; the same sum without the flag moves the adapter."""
    strategy = FedAvg()
    state = GlobalState(ADAPTER, strategy.init_extras(ADAPTER), 0)
    fed = SimpleNamespace(
        strategy=strategy,
        state=state,
        cfg=SimpleNamespace(min_train_nodes=1),
        budget=NoBudget(),
        roster=SimpleNamespace(partitions={11: 0, 12: 1}),
        committed={},
    )
    cohort = SimpleNamespace(sampled=[11, 12], population=2, draw=None)
    result = AggregateResult(_round(strategy, [1.0, 1.0]), accepted=[11, 12])
    result.out_of_bounds = "summed meta/weight 1e7 exceeds 2 clients x max-client-weight=500"
    status = aggregate_and_account(fed, cohort, result, 1)  # type: ignore[arg-type]
    assert status == "out-of-bounds" and fed.committed == {}
    assert fed.state.server_round == 1 and fed.state.adapter is ADAPTER
    result.out_of_bounds = None
    assert aggregate_and_account(fed, cohort, result, 2) == "ok"  # type: ignore[arg-type]
    np.testing.assert_allclose(fed.state.adapter["a.lora_B"], 1.0)
    assert fed.committed == {0: 2, 1: 2}
