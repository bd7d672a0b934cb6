"""fedge.server.secagg.strategy.SecAggPlus refuses what SecAgg+ cannot carry, naming the fix.

Its rounds over a real Flower ServerApp and ClientApp run in
tests/strategies/test_flower_app_example.py.
"""

from __future__ import annotations

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
