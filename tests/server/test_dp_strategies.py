"""DP for any Flower ServerApp: fedge's CentralDP and SecAggPlus(dp=DistributedDP(...)) under
Flower's own ``Strategy.start``, and Flower's DP wrappers around fedge's strategies.

Every run is a real Flower ServerApp and ClientApp on fedge's in-process grid
(``fedge.simulations.inprocess``). The ClientApp moves each node's model by a fixed vector
(node p: a unit direction times 2 (p + 1), on a 64 x 64 linear layer), so the clipped
updates, their uniform mean and the noise on it are known exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Result,
)
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedge.clients.mods import dispatch_mods
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.privacy.accounting import gaussian_epsilon
from fedge.server.privacy.aggregators import DistributedDPAggregator
from fedge.server.privacy.release import MET_CLIP, MET_EPSILON, MET_EXHAUSTED
from fedge.server.privacy.strategy import AdaptiveClip, CentralDP, update_noise_multiplier
from fedge.server.secagg.strategy import DistributedDP, SecAggPlus
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.strategies.base import NoReplyAccepted, UniformWeighting
from fedge.strategies.client import TrainRound
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_dp import FlowerDPWrapperRefused
from fedge.strategies.robust import RobustConfig
from fedge.strategies.scaffold import Scaffold

NODES, SIZE = 4, 64


def direction(partition: int) -> np.ndarray:
    """Node ``partition``'s update: a fixed unit direction times 2 (partition + 1)."""
    v = np.random.default_rng(partition).normal(size=(SIZE, SIZE))
    return (v / np.linalg.norm(v) * 2.0 * (partition + 1)).astype(np.float32)


def fixed_update_app(
    fail_partition: int | None = None,
    flower_shape: bool = False,
    heavy_partition: int | None = None,
) -> ClientApp:
    """A ClientApp whose node p adds ``direction(p)`` to the weight and replies through TrainRound
    (or, ``flower_shape``, as Flower's quickstart: its arrays and ``num-examples``), claiming
    10 (p + 1) examples; ``fail_partition`` raises in training; ``heavy_partition`` sends no
    update but claims 10^7 examples."""
    app = ClientApp(mods=[dispatch_mods])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        p = int(context.node_config["partition-id"])
        if p == fail_partition:
            raise RuntimeError("this node crashes while training")
        net = torch.nn.Linear(SIZE, SIZE, bias=False)
        fl = TrainRound.start(msg, context, net)
        if p == heavy_partition:
            return fl.reply(num_examples=10**7, local_steps=1, lr=1.0)
        with torch.no_grad():
            net.weight.add_(torch.from_numpy(direction(p)))
        if flower_shape:
            metrics = MetricRecord({"num-examples": 10 * (p + 1)})
            content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
            return Message(content, reply_to=msg)
        return fl.reply(num_examples=10 * (p + 1), local_steps=1, lr=1.0)

    return app


def run(
    strategy: FlowerStrategy, tmp: Path, rounds: int = 1, app: ClientApp | None = None
) -> tuple[Result, InProcessGrid]:
    """Run ``strategy.start`` in a Flower ServerApp on the in-process grid; the Result and grid."""
    out: dict[str, Result] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        initial = ArrayRecord({"weight": torch.zeros(SIZE, SIZE)})
        out["result"] = strategy.start(
            grid=grid, initial_arrays=initial, num_rounds=rounds, train_config=ConfigRecord()
        )

    grid = InProcessGrid(app or fixed_update_app(), DeviceTable(NODES), tmp / "state")
    run_inprocess(server, grid)
    return out["result"], grid


def final_weight(result: Result) -> np.ndarray:
    """The Result's model."""
    return result.arrays["weight"].numpy()


def fedavg(**kwargs: Any) -> FedAvg:
    """fedge's FedAvg sampling every node every round, evaluation off."""
    return FedAvg(min_train_nodes=NODES, min_available_nodes=NODES, fraction_evaluate=0.0, **kwargs)


@pytest.fixture(autouse=True)
def _ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys and ledgers of this test's nodes under its own directory."""
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "ledger"))


# ---------------------------------------------------------------- Flower's own DP wrappers
class WithExtraKey(FedAvg):
    """A user's subclass whose configure_train adds a key and calls super()."""

    def __init__(self) -> None:
        super().__init__(min_train_nodes=NODES, min_available_nodes=NODES, fraction_evaluate=0.0)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Any:
        config["extra"] = 1
        return super().configure_train(server_round, arrays, config, grid)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda s: DifferentialPrivacyServerSideFixedClipping(s, 1.0, 1.0, NODES),
        lambda s: DifferentialPrivacyClientSideFixedClipping(s, 1.0, 1.0, NODES),
        lambda s: DifferentialPrivacyServerSideFixedClipping(SecAggPlus(s), 1.0, 1.0, NODES),
        lambda s: DifferentialPrivacyServerSideFixedClipping(WithExtraKey(), 1.0, 1.0, NODES),
    ],
    ids=["server-side", "client-side", "around-secagg", "user-subclass"],
)
def test_flower_dp_wrappers_around_fedge_are_refused_naming_the_reason(
    wrap: Callable[[Any], FlowerStrategy], tmp_path: Path
) -> None:
    """Flower's DifferentialPrivacyServerSideFixedClipping around fedge's FedAvg crashed in its
    clipping (``ValueError: zip() argument 2 is shorter than argument 1``: it zips a reply's
    contribution, delta/weight plus meta/weight and meta/count, against the model's one array);
    the client-side wrapper (no client mod clips fedge's contribution) and the server-side one
    around SecAggPlus (no reply to clip) ran to the end without an error, noising updates
    that were never clipped (all three RUN against the code before). Now the first
    configure_train refuses, before any message leaves, naming why and fedge's wrappers."""
    # Prepare
    strategy = wrap(fedavg())
    # Execute
    with pytest.raises(FlowerDPWrapperRefused) as refused:
        run(strategy, tmp_path)
    # Assert
    reason = str(refused.value)
    assert "contribution record" in reason and "CentralDP" in reason
    assert "SecAggPlus(strategy, dp=DistributedDP" in reason


# ---------------------------------------------------------------- central DP
@pytest.mark.parametrize("flower_shape", [False, True], ids=["trainround", "flower-reply"])
def test_central_dp_clips_each_update_weighs_each_node_once_and_noises_the_sum(
    flower_shape: bool, tmp_path: Path
) -> None:
    """Updates of norm 2, 4, 6, 8 clipped to C = 0.5 (each then d_p / |d_p| x 0.5), each weighing
    1 whatever num-examples it reports (10..40; a Flower quickstart reply arrives as
    n (local - global) with weight n and is divided back): the model is
    mean(clipped) + N(0, (z C)^2) / 4.
    With z = 0.8 the 4,096 residuals x 4 have std z C = 0.4 (their sample std is within 4%: a
    chi-square bound far beyond 5 sigma), and the Result's round-1 epsilon is one Gaussian
    release of z = 0.8 (RDP, delta 1e-5) as dp-accounting computes it."""
    # Prepare
    z, clip = 0.8, 0.5
    strategy = CentralDP(fedavg(), noise_multiplier=z, clip=clip)
    expected = sum(direction(p) / np.linalg.norm(direction(p)) * clip for p in range(NODES))
    # Execute
    result, _ = run(strategy, tmp_path, app=fixed_update_app(flower_shape=flower_shape))
    # Assert
    residual = (final_weight(result) - expected / NODES) * NODES
    assert abs(float(residual.std()) / (z * clip) - 1) < 0.04
    assert abs(float(residual.mean())) < 0.05
    metrics = result.train_metrics_clientapp[1]
    assert metrics[MET_EPSILON] == pytest.approx(gaussian_epsilon([z], 1e-5, "rdp"))
    assert metrics[MET_CLIP] == clip
    assert isinstance(strategy.inner, UniformWeighting)


def test_central_dp_refuses_the_round_that_would_overspend_before_sending_it(
    tmp_path: Path,
) -> None:
    """z = 1, max_epsilon between the epsilon of 2 and of 3 releases: rounds 1-2 train, round 3
    sends no message (4 x 2 train messages in all), its metrics say so, the model stays that of
    round 2, and the Result's epsilon never exceeds max_epsilon."""
    # Prepare
    two, three = (gaussian_epsilon([1.0] * n, 1e-5, "rdp") for n in (2, 3))
    strategy = CentralDP(fedavg(), noise_multiplier=1.0, clip=1.0, max_epsilon=(two + three) / 2)
    # Execute
    result, grid = run(strategy, tmp_path, rounds=4)
    # Assert
    assert grid.messages_run == 2 * NODES
    assert result.train_metrics_clientapp[2][MET_EPSILON] == pytest.approx(two)
    for r in (3, 4):
        assert result.train_metrics_clientapp[r][MET_EXHAUSTED] == 1.0
        assert result.train_metrics_clientapp[r][MET_EPSILON] == pytest.approx(two)
    assert strategy.epsilon <= strategy.account.cfg.max_epsilon


def test_central_dp_can_raise_flowers_budget_exception_instead(tmp_path: Path) -> None:
    """``on_budget="raise"``: Flower's PrivacyBudgetExhausted, naming both epsilons, before
    round 2's messages leave."""
    # Prepare
    one = gaussian_epsilon([1.0], 1e-5, "rdp")
    strategy = CentralDP(
        fedavg(), noise_multiplier=1.0, clip=1.0, max_epsilon=one * 1.01, on_budget="raise"
    )
    # Execute / Assert
    with pytest.raises(PrivacyBudgetExhausted, match="round 2: its release would bring epsilon"):
        run(strategy, tmp_path, rounds=2)


def test_adaptive_clip_follows_the_update_norms(tmp_path: Path) -> None:
    """Andrew et al.'s geometric rule, by hand: from C = 0.1 every update (norms 2..8) is
    clipped, so the noised unclipped fraction b is ~0 (count noise 0.05 / 4 nodes) and
    C grows by exp(-0.2 (b - 0.5)) ~ exp(0.1) a round: 0.1, 0.1105, 0.1221. The updates'
    noise multiplier is (z^-2 - (2 x 0.05)^-2)^-1/2 for z = 0.01: 0.010050."""
    # Prepare
    adaptive = AdaptiveClip(initial_norm=0.1, count_stddev=0.05)
    strategy = CentralDP(fedavg(), noise_multiplier=0.01, clip=adaptive)
    # Execute
    result, _ = run(strategy, tmp_path, rounds=3)
    # Assert
    clips = [result.train_metrics_clientapp[r][MET_CLIP] for r in (1, 2, 3)]
    assert clips[0] == 0.1
    assert clips[1] == pytest.approx(0.1 * math.exp(0.1), rel=0.01)
    assert clips[2] == pytest.approx(0.1 * math.exp(0.2), rel=0.02)
    assert update_noise_multiplier(0.01, 0.05) == pytest.approx(0.010050, rel=1e-4)
    with pytest.raises(ValueError, match="count_stddev"):
        update_noise_multiplier(1.0, 0.4)


def test_central_dp_refuses_rules_and_strategies_it_cannot_bound() -> None:
    """A robust rule changes what one client can move; Flower's own FedAvg has its own wrapper."""
    with pytest.raises(ValueError, match="robust"):
        CentralDP(fedavg(robust=RobustConfig(rule="median")), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="DifferentialPrivacyServerSideFixedClipping"):
        CentralDP(FlowerFedAvgAlias(), noise_multiplier=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip"):
        CentralDP(fedavg(), noise_multiplier=1.0, clip=-1.0)


def FlowerFedAvgAlias() -> FlowerStrategy:
    """Flower's own FedAvg."""
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    return FlowerFedAvg()


# ---------------------------------------------------------------- distributed DP under SecAgg+
def test_distributed_dp_is_one_object_with_epsilon_in_the_result(tmp_path: Path) -> None:
    """SecAggPlus(Scaffold(), dp=DistributedDP(...)): Scaffold is weighed uniformly, each node
    clips to C and adds its noise share; two rounds are two releases of z, in the Result."""
    # Prepare
    z = 0.9
    strategy = SecAggPlus(
        Scaffold(min_train_nodes=NODES, min_available_nodes=NODES, fraction_evaluate=0.0),
        dp=DistributedDP(noise_multiplier=z, clip_norm=0.5),
    )
    # Execute
    result, _ = run(strategy, tmp_path, rounds=2)
    # Assert
    assert isinstance(strategy.inner, UniformWeighting)
    for r in (1, 2):
        assert result.train_metrics_clientapp[r][MET_EPSILON] == pytest.approx(
            gaussian_epsilon([z] * r, 1e-5, "rdp")
        )
    assert np.isfinite(final_weight(result)).all() and np.abs(final_weight(result)).max() > 0


@pytest.mark.parametrize("old_style", [False, True], ids=["dp-argument", "replaced-aggregator"])
def test_a_failing_distributed_dp_round_names_its_cause(
    old_style: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 3 crashes while training; min_survival 1.0 needs all 4. The old way to get distributed
    DP (replacing ``SecAggPlus.aggregator`` with a DistributedDPAggregator) then raised
    ``AttributeError: 'DistributedDPAggregator' object has no attribute 'last_failure'`` and hid
    the cause (RUN against the code before); now the round is skipped and its error line and
    ``last_failure`` name the bound that failed: "need at least 4"."""
    # Prepare
    dp = DistributedDP(noise_multiplier=1.0, clip_norm=1.0, min_survival=1.0)
    if old_style:
        strategy = SecAggPlus(UniformWeighting(fedavg()))
        strategy.aggregator = DistributedDPAggregator(strategy.aggregator, dp.config())  # type: ignore[assignment]
    else:
        strategy = SecAggPlus(fedavg(), dp=dp)
    # Execute
    with caplog.at_level(logging.ERROR), pytest.raises(NoReplyAccepted, match="need at least 4"):
        run(strategy, tmp_path, app=fixed_update_app(fail_partition=3))  # nothing applied
    # Assert
    assert strategy.last_failure is not None and "need at least 4" in strategy.last_failure
    assert any("need at least 4" in r.getMessage() for r in caplog.records)
    assert strategy.epsilon == 0.0  # nothing released


def unclipped_quantize(vec: np.ndarray, clip: float, levels: int, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """A malicious client's quantizer: no clipping, any value mod 2^32 (no range proofs)."""
    scaled = rng.random(vec.shape) + vec * (levels / (2.0 * clip)) + levels / 2.0
    return (scaled.astype(np.uint64) % 2**32).astype(np.uint32)


def test_a_sum_out_of_the_secagg_bounds_is_not_applied_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A malicious node skips the range clip and quantizes weight 10^7 (it sends no update)
    under SecAggPlus(FedAvg()) with example weighting: the unmasked sum's weight is above what
    4 honest nodes can encode (4 x 8,000). SecAggPlus applied such a sum anyway (the
    aggregator's ``out_of_bounds`` was never read: RUN against the code before, the round's
    model was the 4 nodes' mean shrunk 10^5-fold towards the attacker's zero update); now the
    round keeps the model and its error line and ``last_failure`` name the bound."""
    # Prepare
    import fedge.clients.secagg.engine as client_engine
    import fedge.clients.secagg.mod as client_mod

    monkeypatch.setattr(client_mod, "_clip_to_range", lambda arrays, rec: arrays)
    monkeypatch.setattr(client_engine, "quantize", unclipped_quantize)
    strategy = SecAggPlus(fedavg())
    # Execute
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(NoReplyAccepted, match="max-client-weight=8000"),  # nothing applied
    ):
        run(strategy, tmp_path, app=fixed_update_app(heavy_partition=0))
    # Assert
    assert strategy.last_failure is not None and "max-client-weight=8000" in strategy.last_failure
    assert any("max-client-weight=8000" in r.getMessage() for r in caplog.records)
