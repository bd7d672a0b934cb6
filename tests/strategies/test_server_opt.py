"""Server optimizers on the mean delta: a FedAdam step by hand, state in the extras, every strategy."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedge import keys
from fedge.server.config import RunConfig
from fedge.strategies.base import ClientResult, GlobalState, build_contribution, sum_contributions
from fedge.strategies.registry import build_strategy
from fedge.strategies.server_opt import PREFIX_MOMENT1, PREFIX_MOMENT2, SERVER_OPTIMIZERS
from tests.simulations.federations import TINY_TRAINING

X0 = np.array([1.0, 2.0], np.float32)


def _summed(strategy, deltas, weights):  # type: ignore[no-untyped-def]
    """The round's sum of contributions of clients with these deltas and example counts."""
    return sum_contributions(
        [
            build_contribution(ClientResult({"w": np.array(d, np.float32)}, n), "examples", False)
            for d, n in zip(deltas, weights, strict=True)
        ]
    )


def test_fedadam_step_by_hand() -> None:
    """Two clients, weights 1 and 3, deltas [2, -0.4] and [0, 0]: mean delta D = [0.5, -0.1].

    FedAdam (Reddi et al. 2021, Flower's bias-corrected form), eta 0.1, beta1 0.9,
    beta2 0.99, tau 1e-3, from zero moments, round t = 1:
      m1 = (1 - beta1) D       = [0.05, -0.01]
      v1 = (1 - beta2) D^2     = [0.0025, 0.0001],  sqrt(v1) = [0.05, 0.01]
      eta_t = eta sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)) = 0.1 sqrt(0.0199) / 0.19 = 0.0742460
      x1 = x0 + eta_t m1 / (sqrt(v1) + tau)
         = [1 + 0.0742460 * 0.05 / 0.051, 2 - 0.0742460 * 0.01 / 0.011]
         = [1.0727902, 1.9325036]
    Round 2 with the same D: m2 = 0.9 m1 + 0.1 D = [0.095, -0.019],
      v2 = 0.99 v1 + 0.01 D^2 = [0.004975, 0.000199],
      eta_t = 0.1 sqrt(1 - 0.99^3) / (1 - 0.9^3) = 0.0635940,
      x2 = x1 + eta_t m2 / (sqrt(v2) + tau).
    """
    # Prepare
    cfg = {"server-optimizer": "fedadam", "server-lr": 0.1, "server-tau": 1e-3}
    strategy = build_strategy(cfg)
    state = GlobalState({"w": X0.copy()}, strategy.init_extras({"w": X0}))
    summed = _summed(strategy, [[2.0, -0.4], [0.0, 0.0]], [1, 3])
    # Execute
    one = strategy.finalize(state, summed, population=2)
    fresh = build_strategy(cfg)  # a new object: every bit of optimizer state is in the extras
    two = fresh.finalize(one, summed, population=2)
    # Assert
    eta1 = 0.1 * math.sqrt(1 - 0.99**2) / (1 - 0.9**2)
    assert eta1 == pytest.approx(0.0742460, rel=1e-6)
    np.testing.assert_allclose(one.adapter["w"], [1.0727902, 1.9325036], rtol=1e-6)
    np.testing.assert_allclose(one.extras[PREFIX_MOMENT1 + "w"], [0.05, -0.01], rtol=1e-5)
    np.testing.assert_allclose(one.extras[PREFIX_MOMENT2 + "w"], [0.0025, 0.0001], rtol=1e-5)
    m2, v2 = np.array([0.095, -0.019]), np.array([0.004975, 0.000199])
    eta2 = 0.1 * math.sqrt(1 - 0.99**3) / (1 - 0.9**3)
    expected = np.array([1.0727902, 1.9325036]) + eta2 * m2 / (np.sqrt(v2) + 1e-3)
    np.testing.assert_allclose(two.adapter["w"], expected, rtol=1e-6)
    assert two.server_round == 2


def test_fedavgm_step_by_hand() -> None:
    """FedAvgM, lr 1, momentum 0.9, mean delta D twice: x1 = x0 + D, x2 = x1 + (0.9 + 1) D."""
    strategy = build_strategy({"server-optimizer": "fedavgm", "server-momentum": 0.9})
    state = GlobalState({"w": X0.copy()}, strategy.init_extras({"w": X0}))
    summed = _summed(strategy, [[0.5, -0.1]], [1])
    one = strategy.finalize(state, summed, 1)
    two = strategy.finalize(one, summed, 1)
    np.testing.assert_allclose(one.adapter["w"], X0 + np.array([0.5, -0.1]), rtol=1e-6)
    np.testing.assert_allclose(two.adapter["w"], X0 + 2.9 * np.array([0.5, -0.1]), rtol=1e-6)


@pytest.mark.parametrize("strategy_name", ["fedavg", "fedprox", "scaffold"])
@pytest.mark.parametrize("optimizer", SERVER_OPTIMIZERS)
def test_every_strategy_takes_every_server_optimizer(strategy_name: str, optimizer: str) -> None:
    """The optimizer moves the adapter; SCAFFOLD's c still moves by sum(ctrl)/N; clients get c only."""
    strategy = build_strategy(
        {"strategy": strategy_name, "server-optimizer": optimizer, "server-lr": 0.1}
    )
    state = GlobalState({"w": X0.copy()}, strategy.init_extras({"w": X0}))
    contribution = build_contribution(
        ClientResult(
            {"w": np.array([0.5, -0.1], np.float32)},
            4,
            extras={keys.PREFIX_CONTROL + "w": np.array([0.2, 0.4], np.float32)}
            if strategy_name == "scaffold"
            else {},
        ),
        "examples",
        True,
    )
    new = strategy.finalize(state, sum_contributions([contribution]), population=2)
    assert not np.allclose(new.adapter["w"], X0)
    assert not any(k.startswith("opt/") for k in strategy.client_payload(new))
    if strategy_name == "scaffold":
        np.testing.assert_allclose(new.extras[keys.PREFIX_CONTROL + "w"], [0.1, 0.2])
        assert set(strategy.client_payload(new)) == {keys.PREFIX_CONTROL + "w"}
    assert (optimizer == "none") == (not any(k.startswith("opt/") for k in new.extras))


def test_plain_step_is_unchanged_bit_for_bit() -> None:
    """server-optimizer = none keeps fedge's original x + lr * sum / weight, in that order."""
    strategy = build_strategy({"server-lr": 0.7})
    summed = _summed(strategy, [[0.3, 0.1], [0.7, -0.9]], [3, 7])
    new = strategy.finalize(GlobalState({"w": X0.copy()}), summed, 2)
    expected = (X0 + 0.7 * summed["delta/w"] / float(summed[keys.KEY_WEIGHT][0])).astype(np.float32)
    np.testing.assert_array_equal(new.adapter["w"], expected)


def test_run_config_names_a_bad_server_optimizer_key() -> None:
    """Bad names and ranges are refused naming the key."""
    with pytest.raises(ValueError, match="server-optimizer"):
        RunConfig.from_mapping({"server-optimizer": "adam"})
    with pytest.raises(ValueError, match="server-beta1"):
        RunConfig.from_mapping({"server-beta1": 1.5})
    assert RunConfig.from_mapping({"server-optimizer": "fedyogi"}).server_optimizer == "fedyogi"


def _federation(run_dir: Path, rounds: int, tmp_path: Path, resume: bool = False):  # type: ignore[no-untyped-def]
    """fedge's own loop with FedAdam on the micro zoo, two in-process nodes; its outcome."""
    from flwr.clientapp import ClientApp

    from fedge.clients import app as deployed
    from fedge.server.app import OutcomeBox, make_server_app
    from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

    cfg = RunConfig.from_mapping(
        {
            "model": "zoo:micro",
            "num-server-rounds": rounds,
            **TINY_TRAINING,
            "run-dir": str(run_dir),
            "server-optimizer": "fedadam",
            "server-lr": 0.01,
            "tensorboard": False,
        }
    )
    app = ClientApp()
    app.query()(deployed.query)
    app.train()(deployed.train)
    box = OutcomeBox()
    grid = InProcessGrid(app, DeviceTable(2), tmp_path / f"state-{run_dir.name}-{resume}")
    run_inprocess(make_server_app(cfg, resume=resume, box=box), grid)
    assert box.outcome is not None and box.outcome.status == "completed", box.outcome
    return box.outcome


def test_fedadam_moments_are_checkpointed_and_a_resumed_run_matches(
    micro_zoo, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The real loop: 3 rounds straight, and 2 rounds then --resume to 3, end on the same
    adapter bit for bit; the moments (opt/m/, opt/v/) were in the round-2 checkpoint."""
    from fedge.server.checkpoint import load_checkpoint

    straight = _federation(tmp_path / "a", 3, tmp_path)
    _federation(tmp_path / "b", 2, tmp_path)
    saved = load_checkpoint(tmp_path / "b", 2).state.extras
    assert any(k.startswith(PREFIX_MOMENT2) and np.any(v) for k, v in saved.items())
    resumed = _federation(tmp_path / "b", 3, tmp_path, resume=True)
    for k, v in straight.state.adapter.items():
        np.testing.assert_array_equal(resumed.state.adapter[k], v)
