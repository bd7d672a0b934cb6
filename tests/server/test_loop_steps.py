"""The round loop's steps, each alone: what counts toward min-train-nodes, and sampling."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fedge.server.aggregation import AggregateResult
from fedge.server.budget import NoBudget
from fedge.server.loop import aggregate_and_account, next_state, updates_in
from fedge.strategies.base import ClientResult, GlobalState, build_contribution, sum_contributions
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.scaffold import Scaffold

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
    from fedge.strategies.fedprox import FedProx

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


def test_the_plateau_stop_waits_patience_rounds_without_a_real_improvement_on_the_best() -> None:
    """Hand-derived: 100, 90, 85, 84.8, 84.9 with patience 2 and 1%. After round 3 the best of
    rounds 0-1 is 90 and 84.8 < 89.1: go on. After round 4 the best of rounds 0-2 is 85 and
    neither 84.8 nor 84.9 is below 84.15: stop. With no threshold 84.8 < 85 counts (go on);
    with patience 3 the reference is 90 again (go on); skipped evaluations (None) are not rounds.
    A drop to 80 inside the window counts though the last round rose; a best of 80 two rounds
    before the window is the reference (84 is not below 79.2)."""
    from fedge.server.plateau import plateaued

    curve = [100.0, 90.0, 85.0, 84.8, 84.9]
    assert not plateaued(curve[:4], 2, 0.01)
    assert plateaued(curve, 2, 0.01)
    assert not plateaued(curve, 2, 0.0)
    assert not plateaued(curve, 3, 0.01)
    assert plateaued([100.0, None, 90.0, None, 85.0, 84.8, 84.9], 2, 0.01)
    assert not plateaued([100.0, 90.0, 85.0, 80.0, 84.9], 2, 0.01)  # any round of the window
    assert plateaued([100.0, 80.0, 85.0, 84.0, 84.5], 2, 0.01)  # the best, not the last, before
    assert not plateaued([100.0, 101.0], 2, 0.01)  # fewer rounds than patience after round 0
    assert not plateaued(curve, 0, 0.01)  # off


def test_the_loop_reads_the_plateau_from_the_rows_it_wrote(tmp_path: Path) -> None:
    """``plateau_reached`` reads the participants' perplexity of the metrics rows on disk with
    the run's ``plateau-*`` keys; bad values are refused naming the keys."""
    from fedge.server.config import RunConfig
    from fedge.server.loop import plateau_reached
    from fedge.server.rundir import MetricsLog

    cfg = RunConfig.from_mapping({"plateau-patience": 2, "plateau-min-improvement": 0.01})
    fed = SimpleNamespace(cfg=cfg, metrics=MetricsLog(tmp_path))
    for server_round, ppl in enumerate([100.0, 90.0, 85.0, 84.8, 84.9]):
        fed.metrics.append({"round": server_round, "participants_perplexity": ppl})
        assert plateau_reached(fed) == (server_round == 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plateau-min-improvement"):
        RunConfig.from_mapping({"plateau-patience": 2, "plateau-min-improvement": 1.5})


def test_a_run_stops_after_max_rejected_rounds_saying_which_bound_failed() -> None:
    """Under SecAgg+ a poisoned client gets every round's sum rejected; before, the run went on
    to its last round at the initial model without a word. Now the third rejected round (the
    default max-rejected-rounds) stops it with the bound that failed; 0 never stops."""
    from fedge.server.loop import rejected_rounds_reached

    rows: list[dict[str, object]] = [{"status": "ok"}, {"status": "out-of-bounds"}]
    fed = SimpleNamespace(
        cfg=SimpleNamespace(max_rejected_rounds=3), metrics=SimpleNamespace(rows=lambda: rows)
    )
    result = AggregateResult(None)
    result.out_of_bounds = "summed update norm 9.1 (ctrl 0) exceeds the bound of 3 clients"
    assert rejected_rounds_reached(fed, result) is None  # type: ignore[arg-type]
    rows.append({"status": "out-of-bounds"})
    assert rejected_rounds_reached(fed, result) is None  # type: ignore[arg-type]
    rows.append({"status": "out-of-bounds"})
    stop = rejected_rounds_reached(fed, result)  # type: ignore[arg-type]
    assert stop is not None and "max-rejected-rounds=3" in stop and "summed update norm" in stop
    assert rejected_rounds_reached(fed, AggregateResult(None)) is None  # type: ignore[arg-type]
    fed.cfg.max_rejected_rounds = 0
    assert rejected_rounds_reached(fed, result) is None  # type: ignore[arg-type]
