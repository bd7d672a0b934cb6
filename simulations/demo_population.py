"""The demo's population stage: private learning with a cohort large enough for DP to be cheap.

Runs the ``demo_population`` scenario (``simulations/scenarios/demo_population.toml``: 500
simulated phones on the in-process engine, Poisson cohorts of 50 from the phones eligible
under the virtual clock) twice with the same cohort law: plain, then SecAgg+ with
distributed DP. Each run's figures are read back from its run directory (metrics rows,
device summary, resolved config), so the report shows what the runs wrote: participants'
held-out perplexity before and after, epsilon at delta = 1/population (amplified by the
Poisson draw, and the server's unamplified view: the server knows the cohort), simulated
hours and the stage's own wall time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedge.server.rundir import MetricsLog, read_config
from fedge.simulations.runner import Scenario, load_scenario, run_simulation
from fedge.tables import wrapping_table

POPULATION_SCENARIO = "demo_population"
PLAIN_OVERRIDES: dict[str, Any] = {"aggregator": "plain"}  # same cohort law, no DP, no SecAgg+
ARMS: tuple[tuple[str, dict[str, Any]], ...] = (("plain", PLAIN_OVERRIDES), ("secagg+dp", {}))


@dataclass(frozen=True)
class PopulationRun:
    """One population federation's figures, as its run directory records them."""

    label: str
    run_dir: str
    population: int
    cohort: int  # target-reports: the expected cohort K
    mean_cohort: float  # cohorts actually drawn (Poisson: the size varies)
    rounds: int
    participating: tuple[float, float]  # participants' held-out perplexity, round 0 -> last
    epsilon: float | None  # amplified by the Poisson draw (None without DP)
    epsilon_server: float | None  # the same releases unamplified: what the server can claim
    delta: float | None
    accountant: str | None
    simulated_hours: float
    wall_seconds: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {**asdict(self), "participating": list(self.participating)}


def population_scenario(
    target: str, overrides: Mapping[str, Any] | None = None, population: int = 0
) -> Scenario:
    """The population scenario on model `target`; `population` > 0 replaces its size."""
    scenario = load_scenario(POPULATION_SCENARIO, {"model": target, **(overrides or {})})
    return replace(scenario, num_supernodes=population) if population else scenario


def read_population_run(run_dir: Path, label: str, wall_seconds: float = 0.0) -> PopulationRun:
    """A population run's figures from its metrics rows, device summary and resolved config."""
    from fedge.privacy.accounting import gaussian_epsilon

    rows = [r for r in MetricsLog(run_dir).rows() if r["status"] == "ok"]
    config = read_config(run_dir)
    devices = json.loads((run_dir / "devices" / "summary.json").read_text())
    population = int(devices["devices"])
    private = rows[-1].get("epsilon_accountant") is not None
    delta = float(config["dp-target-delta"]) if private else None
    accountant = str(rows[-1]["epsilon_accountant"]) if private else None
    releases = len(rows) - 1  # every ok round after round 0 released a noised sum
    sampled = [int(r["clients_sampled"]) for r in rows[1:]]
    return PopulationRun(
        label=label,
        run_dir=str(run_dir),
        population=population,
        cohort=int(config["target-reports"]),
        mean_cohort=sum(sampled) / len(sampled) if sampled else 0.0,
        rounds=int(rows[-1]["round"]),
        participating=(rows[0]["participants_perplexity"], rows[-1]["participants_perplexity"]),
        epsilon=float(rows[-1]["epsilon"]) if private else None,
        epsilon_server=gaussian_epsilon(
            [float(config["dp-noise-multiplier"])] * releases,
            delta,
            accountant,  # type: ignore[arg-type]
        )
        if private and delta is not None
        else None,
        delta=delta,
        accountant=accountant,
        simulated_hours=float(devices["simulated_hours"]),
        wall_seconds=wall_seconds,
    )


def population_stage(
    target: str,
    run_dir: Path,
    console: Console,
    overrides: Mapping[str, Any] | None = None,
    population: int = 0,
) -> dict[str, Any]:
    """Run the population scenario plain and under SecAgg+ with distributed DP; their figures."""
    scenario = population_scenario(target, overrides, population)
    cfg = scenario.config
    console.print(
        f"{scenario.num_supernodes} simulated phones, Poisson cohorts of "
        f"{cfg.target_reports} from the phones eligible each round, {cfg.num_server_rounds} "
        f"rounds, {scenario.engine} engine; plain, then SecAgg+ with distributed DP "
        f"(noise {cfg.extra['dp-noise-multiplier']}, clip {cfg.extra['dp-clip-norm']})"
    )
    started = time.perf_counter()
    runs: dict[str, PopulationRun] = {}
    for label, arm in ARMS:
        arm_scenario = population_scenario(target, {**(overrides or {}), **arm}, population)
        runs[label] = _run_arm(arm_scenario, run_dir / label.replace("+", "-"), label, console)
    console.print(population_table(list(runs.values())))
    return {
        "plain": runs["plain"].as_dict(),
        "private": runs["secagg+dp"].as_dict(),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _run_arm(scenario: Scenario, run_dir: Path, label: str, console: Console) -> PopulationRun:
    """One run of the population scenario, its round shown as it goes."""
    rounds = scenario.config.num_server_rounds
    t0 = time.perf_counter()
    with console.status(f"population ({label}): starting") as status:

        def on_row(row: Mapping[str, Any]) -> None:
            ppl = row.get("participants_perplexity")
            shown = f"perplexity {ppl:.2f}" if isinstance(ppl, float) else str(row.get("status"))
            status.update(f"population ({label}): round {row['round']}/{rounds}, {shown}")

        outcome = run_simulation(scenario, run_dir, on_row=on_row)
    if outcome is None or outcome.status == "failed":
        message = outcome.message if outcome is not None else "the ServerApp did not finish"
        raise RuntimeError(f"population run ({label}) failed: {message} (run dir {run_dir})")
    return read_population_run(run_dir, label, round(time.perf_counter() - t0, 1))


def population_table(runs: list[PopulationRun]) -> Table:
    """Participants' perplexity, epsilon and simulated hours of each population run."""
    table = wrapping_table(
        "population: participants' held-out perplexity, base model -> federated adapter",
        ("run", "phones, cohort", "participants' code", "epsilon (delta)", "simulated h"),
    )
    for r in runs:
        table.add_row(
            r.label,
            f"{r.population}, {r.mean_cohort:.0f}",
            change(*r.participating),
            epsilon_text(r.epsilon, r.delta),
            f"{r.simulated_hours:.2f}",
        )
    return table


def epsilon_text(epsilon: float | None, delta: float | None) -> str:
    """'2.81 (1/500)', or '-' without DP."""
    if epsilon is None or delta is None:
        return "-"
    return f"{epsilon:.2f} (1/{round(1 / delta):,})"


def change(before: float, after: float) -> str:
    """'60.24 -> 56.77 (-5.8%)'."""
    return f"{before:.2f} -> {after:.2f} ({(after - before) / before:+.1%})"
