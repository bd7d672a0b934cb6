"""Every strategy under every privacy mode completes a two-round micro federation.

3 strategies x {plain, SecAgg+, central DP, SecAgg+ with distributed DP, DP-SGD}, plus a
central-DP run that must stop on its epsilon budget. All 16 federations run through the
real fedge ServerApp loop and ClientApp on Flower's simulation engine, in ONE Ray run
(one ServerApp that runs the federations one after another) to pay Ray's start-up once.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import tomllib
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from clients.privacy.ledger import STATE_DIR_ENV
from server.config import RunConfig
from server.loop import run_federation
from server.rundir import MetricsLog

STRATEGIES = ("fedavg", "fedprox", "scaffold")
F = "server.privacy.factories:"
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
OUTCOMES: dict[str, Any] = {}


def base_config(run_dir: Path) -> dict[str, Any]:
    """The quick scenario's config, trimmed further: one step, short windows, less evaluation."""
    config = tomllib.loads(QUICK.read_text())["config"]
    trim = {"local-steps": 1, "seq-len": 32, "server-eval-batches": 2, "eval-batches": 1}
    return {**config, **trim, "client-eval": False, "save-merged": False, "run-dir": str(run_dir)}


def federations(root: Path) -> dict[str, RunConfig]:
    """The 15 matrix runs plus one budget-stop run, by name."""
    out = {}
    for strategy in STRATEGIES:
        for mode, overrides in MODES.items():
            name = f"{strategy}-{mode}"
            out[name] = RunConfig.from_mapping(
                {**base_config(root / name), "strategy": strategy, **overrides}
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
def outcomes(micro_zoo, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Run all federations once (one Ray start) and return their outcomes by name."""
    configs = federations(tmp_path_factory.mktemp("matrix"))
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for name, cfg in configs.items():
            try:
                OUTCOMES[name] = run_federation(grid, cfg)
            except Exception as exc:  # recorded and asserted per case below
                OUTCOMES[name] = exc

    from simulations.apps import clientapp as client_app

    os.environ["FEDGE_CONCURRENCY"] = "2"
    with pytest.MonkeyPatch.context() as mp:  # ledgers span runs: this module's own root
        mp.setenv(STATE_DIR_ENV, str(tmp_path_factory.mktemp("node-state")))
        run_simulation(
            server_app=app,
            client_app=client_app,
            num_supernodes=3,
            backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
        )
    return OUTCOMES


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
    assert (outcome.run_dir / "privacy.png").is_file()


def test_budget_stops_the_run_cleanly_with_a_checkpoint(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["budget"]
    rows = rows_of(outcome)
    assert outcome.status == "budget"
    assert "max-epsilon=8.0" in outcome.message
    assert [r["round"] for r in rows] == [1]
    assert rows[0]["epsilon"] <= 8.0
    assert rows[0]["epsilon_accountant"] == "rdp"
    assert outcome.state is not None and outcome.state.server_round == 1


def test_max_epsilon_stops_dp_sgd_clients_without_a_server_budget(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["dp-sgd-budget"]
    assert not isinstance(outcome, Exception), repr(outcome)
    assert outcome.status == "budget", outcome.message
    assert "privacy budget exhausted" in outcome.message
    assert rows_of(outcome) == []  # nothing was released
