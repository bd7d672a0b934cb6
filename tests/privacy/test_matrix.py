"""Every strategy under every privacy mode completes a two-round micro federation.

3 strategies x {plain, SecAgg+, central DP, SecAgg+ with distributed DP, DP-SGD}, plus a
central-DP run that must stop on its epsilon budget. All 17 federations run through the
real fedge ServerApp loop and ClientApp, one after another in ONE ServerApp on the
in-process engine (`fedge.simulations.inprocess`: Flower's Message API, no Ray start-up; the
Ray engine has its own tests in tests/simulations and tests/server).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomllib
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity

from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.server.checkpoint import latest_round, load_checkpoint
from fedge.server.config import RunConfig
from fedge.server.loop import ServerModel, run_federation
from fedge.server.rundir import MetricsLog
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

STRATEGIES = ("fedavg", "fedprox", "scaffold")
PLOTTED = "fedavg"  # the strategy whose runs draw the plots, one per privacy mode
F = "fedge.server.privacy.factories:"
DP = {"weighting": "uniform", "privacy-budget": F + "rdp_budget", "dp-noise-multiplier": 0.8}
MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "secagg": {"aggregator": F + "secagg"},
    "central-dp": {**DP, "aggregator": F + "central_dp", "dp-clip-norm": 0.05},
    "secagg-ddp": {
        **DP,
        "aggregator": F + "secagg_distributed_dp",
        "dp-clip-norm": 0.05,
        "dp-min-survival": 1.0,
    },
    "dp-sgd": {"dp-sgd-noise-multiplier": 1.0, "dp-sgd-max-grad-norm": 1.0},
}
QUICK = Path(__file__).resolve().parents[2] / "simulations" / "scenarios" / "quick.toml"


def base_config(run_dir: Path) -> dict[str, Any]:
    """The quick scenario's config, trimmed further: one step, short windows, less evaluation."""
    config = tomllib.loads(QUICK.read_text())["config"]
    trim = {"local-steps": 1, "seq-len": 32, "server-eval-batches": 2, "eval-batches": 1}
    return {**config, **trim, "client-eval": False, "save-merged": False, "run-dir": str(run_dir)}


def federations(root: Path) -> dict[str, RunConfig]:
    """The 15 matrix runs plus two budget-stop runs, by name.

    The plots depend on the privacy mode's metrics, not on the strategy: FedAvg's runs and
    the budget stops draw them, FedProx's and SCAFFOLD's turn ``plots`` off (drawing was about
    half of this module's set-up time).
    """
    out = {}
    for strategy in STRATEGIES:
        for mode, overrides in MODES.items():
            name = f"{strategy}-{mode}"
            out[name] = RunConfig.from_mapping(
                {
                    **base_config(root / name),
                    "strategy": strategy,
                    "plots": strategy == PLOTTED,
                    **overrides,
                }
            )
    # epsilon after one round at z = 0.8 is about 6.1 (delta 1e-5), after two about 9.2
    out["budget"] = RunConfig.from_mapping(
        {**base_config(root / "budget"), **MODES["central-dp"], "max-epsilon": 8.0}
    )
    # max-epsilon without privacy-budget still stops DP-SGD: every client's own accountant
    # refuses a round that would pass it (0.05 is below one step's epsilon)
    out["dp-sgd-budget"] = RunConfig.from_mapping(
        {**base_config(root / "dp-sgd-budget"), **MODES["dp-sgd"], "max-epsilon": 0.05}
    )
    return out


@pytest.fixture(scope="module")
def configs(micro_zoo, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunConfig]:  # type: ignore[no-untyped-def]
    """Every federation's run config, by name, run directories under one temporary root."""
    return federations(tmp_path_factory.mktemp("matrix"))


@pytest.fixture(scope="module")
def outcomes(
    configs: dict[str, RunConfig], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run all federations once, one after another on one in-process grid; outcomes by name."""
    outcomes: dict[str, Any] = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for name, cfg in configs.items():
            try:
                outcomes[name] = run_federation(grid, cfg)
            except Exception as exc:  # recorded and asserted per case below
                outcomes[name] = exc

    from fedge.simulations.apps import clientapp as client_app

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDGE_CONCURRENCY", "1")  # clients run one at a time, in this thread
        patch.setenv(STATE_DIR_ENV, str(tmp_path_factory.mktemp("node-state")))  # ledgers span runs
        for name in ("_task_id", "_run_id", "_node_id"):  # run_inprocess sets the identity
            patch.setattr(TaskIdentity, name, getattr(TaskIdentity, name))
        nodes = tmp_path_factory.mktemp("nodes")
        run_inprocess(app, InProcessGrid(client_app, DeviceTable(3), nodes))
    return outcomes


def rows_of(outcome: Any) -> list[dict[str, Any]]:
    assert not isinstance(outcome, Exception), repr(outcome)
    return [r for r in MetricsLog(outcome.run_dir).rows() if r["round"] > 0]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_two_round_federation_completes(outcomes: dict[str, Any], strategy: str, mode: str) -> None:
    # Prepare / Execute: the module fixture ran the federation
    outcome = outcomes[f"{strategy}-{mode}"]
    rows = rows_of(outcome)
    # Assert: two released rounds, finite perplexity, epsilon reported where DP is on
    assert outcome.status == "completed", outcome.message
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["status"] == "ok" and r["clients_succeeded"] == 3 for r in rows)
    assert all(r["perplexity"] is not None and math.isfinite(r["perplexity"]) for r in rows)
    eps = [r["epsilon"] for r in rows]
    dpsgd_eps = [r["dp_sgd_epsilon"] for r in rows]
    if mode in ("central-dp", "secagg-ddp"):
        assert 0 < eps[0] < eps[1]
    else:
        assert eps == [0.0, 0.0]
    if mode == "dp-sgd":
        assert 0 < dpsgd_eps[0] < dpsgd_eps[1]  # the client's accountant persisted across rounds
    else:
        assert dpsgd_eps == [None, None]
    plots = [(outcome.run_dir / name).is_file() for name in ("privacy.png", "perplexity.png")]
    assert plots == [strategy == PLOTTED] * 2  # drawn for every mode's metrics; `plots` obeyed


def test_budget_stops_the_run_cleanly_with_a_checkpoint(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["budget"]
    rows = rows_of(outcome)
    assert outcome.status == "budget"
    assert "max-epsilon=8.0" in outcome.message
    assert [r["round"] for r in rows] == [1]
    assert rows[0]["epsilon"] <= 8.0
    assert rows[0]["epsilon_accountant"] == "rdp"
    assert outcome.state is not None and outcome.state.server_round == 1
    # the checkpoint on disk is round 1's released state, the newest one, and resumable
    assert latest_round(outcome.run_dir) == 1
    saved = load_checkpoint(outcome.run_dir)
    assert saved.state.server_round == 1 and saved.strategy == "fedavg"
    assert saved.state.adapter.keys() == outcome.state.adapter.keys()
    for name, array in outcome.state.adapter.items():
        np.testing.assert_array_equal(saved.state.adapter[name], array)
    assert saved.budget_state, "the accountant's spend is saved with the adapter"


def test_max_epsilon_stops_dp_sgd_clients_without_a_server_budget(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["dp-sgd-budget"]
    assert not isinstance(outcome, Exception), repr(outcome)
    assert outcome.status == "budget", outcome.message
    assert "privacy budget exhausted" in outcome.message
    assert rows_of(outcome) == []  # nothing was released


def test_the_loop_scores_the_participants_on_their_own_heldout_text(
    outcomes: dict[str, Any], configs: dict[str, RunConfig]
) -> None:
    """The row's participants' loss is the final adapter's on the 3 nodes' partitions only."""
    outcome, cfg = outcomes["fedavg-plain"], configs["fedavg-plain"]
    last = rows_of(outcome)[-1]
    model = ServerModel(cfg)
    participants = model.evaluate(outcome.state.adapter, [0, 1, 2])
    assert last["participants_eval_loss"] == pytest.approx(participants, rel=1e-6)
    assert last["eval_loss"] == pytest.approx(model.evaluate(outcome.state.adapter), rel=1e-6)
    assert participants != pytest.approx(last["eval_loss"], rel=1e-3)  # the two differ
