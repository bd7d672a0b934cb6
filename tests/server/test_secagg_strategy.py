"""fedge.server.secagg.strategy.SecAggPlus refuses what SecAgg+ cannot carry, naming the fix.

Its rounds over a real Flower ServerApp and ClientApp run in
tests/strategies/test_flower_app_example.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedge.secagg.config import DEFAULT_MAX_WEIGHT
from fedge.server.secagg.strategy import SecAggPlus, summed_metrics
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.robust import RobustConfig
from fedge.strategies.scaffold import Scaffold


def test_a_flower_strategy_is_refused() -> None:
    """Flower's FedAvg reads each reply, which SecAgg+ hides: refused, naming fedge's strategies."""
    with pytest.raises(ValueError, match="wraps a fedge strategy"):
        SecAggPlus(FlowerFedAvg())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "robust",
    [RobustConfig(rule="median"), RobustConfig(max_weight=10.0), RobustConfig(max_update_norm=1.0)],
)
def test_rules_that_need_each_update_are_refused(robust: RobustConfig) -> None:
    """A median or a per-client bound needs each client's update; SecAgg+ shows only the sum
    (fedge's FedAvg: SCAFFOLD itself refuses a median, tests/strategies/test_scaffold_exact.py)."""
    with pytest.raises(ValueError, match="pass robust=None"):
        SecAggPlus(FedAvg(robust=robust))


def test_example_weighting_gets_the_weight_divisors() -> None:
    """Example weighting scales delta/ and meta/weight by the expected largest count; uniform none."""
    weighted = SecAggPlus(Scaffold()).aggregator.cfg.key_scales
    assert dict(weighted) == {"delta/": DEFAULT_MAX_WEIGHT, "meta/weight": DEFAULT_MAX_WEIGHT}
    assert SecAggPlus(Scaffold(weighting="uniform")).aggregator.cfg.key_scales == ()


def test_summed_metrics_are_the_total_count_and_plain_means() -> None:
    """Sums 1023.9 examples and 2.0 loss over 4 contributors -> 1024 examples, loss 0.5."""
    metrics = summed_metrics({"num-examples": 1023.9, "train-loss": 2.0}, 4)
    assert metrics is not None
    assert metrics["num-examples"] == 1024 and metrics["train-loss"] == pytest.approx(0.5)
    assert summed_metrics({}, 4) is None


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-scaffold-secagg"


def test_the_flower_app_stops_after_max_rejected_rounds_naming_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/flower-scaffold-secagg's own ServerApp (``SecAggPlus`` around SCAFFOLD) on the
    in-process engine, 4 nodes, 6 rounds, ``max-rejected-rounds = 2``; node 0 claims
    ``meta/count`` 8 (inside the quantizer's range, so its mod masks it), every round's sum
    breaks the count bound. Before, the Flower-app path rejected every sum and ran all 6
    rounds at the initial model, saying only at the end that no round was applied. Now the
    run stops after the second rejected round with an error naming the bound and the key."""
    from flwr.app import Array, ArrayRecord, Context, Message
    from flwr.clientapp import ClientApp

    from fedge import keys
    from fedge.clients.mods import dispatch_mods
    from fedge.clients.privacy.ledger import STATE_DIR_ENV
    from fedge.server.secagg.strategy import RejectedRoundsExceeded
    from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "keys"))
    from scaffoldsecagg import client_app, server_app

    calls = {"poisoned": 0}
    poisoned = ClientApp(mods=[dispatch_mods])

    @poisoned.train()
    def train(msg: Message, context: Context) -> Message:
        reply = client_app.train_fn(msg, context)
        if int(context.node_config["partition-id"]) == 0:
            calls["poisoned"] += 1
            record = reply.content.array_records[keys.REC_CONTRIB]
            arrays = {k: a.numpy() for k, a in record.items()}
            arrays[keys.KEY_COUNT] = np.full_like(arrays[keys.KEY_COUNT], 8.0)
            reply.content[keys.REC_CONTRIB] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        return reply

    config = {
        "num-server-rounds": 6,
        "num-nodes": 4,
        "local-steps": 2,
        "lr": 0.05,
        "final-model": str(tmp_path / "final.pt"),
        keys.CFG_MAX_REJECTED_ROUNDS: 2,
    }
    grid = InProcessGrid(poisoned, DeviceTable(4), tmp_path / "state")
    with pytest.raises(RejectedRoundsExceeded) as info:
        run_inprocess(server_app.app, grid, run_config=config)  # type: ignore[arg-type]
    text = str(info.value)
    assert "max-rejected-rounds=2" in text and "stopped: 2 rounds" in text
    assert "meta/count" in text  # the bound that failed
    assert calls["poisoned"] == 2  # rounds 3 to 6 never ran
    assert not (tmp_path / "final.pt").exists()
