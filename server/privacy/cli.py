"""`fedge privacy`: plan a DP budget before a run, and read what a run spent after it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from server.privacy.accountant import RdpBudget
from server.privacy.config import DPConfig

app = typer.Typer(help="Differential-privacy budget: plan epsilon, report a run's spending.")


@app.command("plan")
def plan(
    noise_multiplier: Annotated[
        float, typer.Option(help="z: noise std in units of the clip C.")
    ] = 1.0,
    rounds: Annotated[int, typer.Option(help="Rounds to account.")] = 10,
    sampled: Annotated[int, typer.Option(help="Clients per round.")] = 4,
    population: Annotated[int, typer.Option(help="Clients in the federation.")] = 4,
    delta: Annotated[float, typer.Option(help="Target delta.")] = 1e-5,
    sampling: Annotated[str, typer.Option(help="none | poisson | without-replacement.")] = "none",
) -> None:
    """Print cumulative user-level epsilon per round for the given mechanism (no training)."""
    try:
        cfg = DPConfig(noise_multiplier=noise_multiplier, target_delta=delta, sampling=sampling)  # type: ignore[arg-type]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if rounds <= 0 or sampled <= 0 or population < sampled:
        raise typer.BadParameter("need rounds > 0 and 0 < sampled <= population")
    budget = RdpBudget(cfg)
    table = Table(
        title=f"z={noise_multiplier}, {sampled}/{population} per round, delta={delta}, sampling={sampling}"
    )
    table.add_column("round")
    table.add_column("epsilon")
    for r in range(1, rounds + 1):
        budget.record(r, sampled, population)
        table.add_row(str(r), f"{budget.epsilon():.3f}")
    Console().print(table)


@app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory of `fedge simulate`.")],
) -> None:
    """Print epsilon (server, DP-SGD) and perplexity per round of a finished or stopped run."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise typer.BadParameter(f"{metrics} does not exist; pass the run directory of a fedge run")
    table = Table(title=str(run_dir))
    for column in ("round", "status", "epsilon", "dp-sgd epsilon", "perplexity"):
        table.add_column(column)
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        table.add_row(
            str(row["round"]),
            str(row.get("status")),
            _fmt(row.get("epsilon")),
            _fmt(row.get("dp_sgd_epsilon")),
            _fmt(row.get("perplexity")),
        )
    status = run_dir / "status.json"
    if status.is_file():
        table.caption = json.loads(status.read_text()).get("message", "")
    Console().print(table)


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{float(value):.3f}"  # type: ignore[arg-type]
