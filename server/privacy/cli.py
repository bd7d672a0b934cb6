"""`fedge privacy`: plan a DP budget before a run, and read what a run spent after it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fedge.privacy.accounting import gaussian_epsilon
from fedge.server.privacy.config import DPConfig

app = typer.Typer(help="Differential-privacy budget: plan epsilon, report a run's spending.")


@app.command("plan")
def plan(
    noise_multiplier: Annotated[
        float, typer.Option(help="z: noise std in units of the clip C.")
    ] = 1.0,
    rounds: Annotated[int, typer.Option(help="Rounds to account.")] = 10,
    delta: Annotated[float, typer.Option(help="Target delta.")] = 1e-5,
) -> None:
    """Print cumulative user-level epsilon per round, RDP and PLD side by side (no training).

    Every round is one full Gaussian release (no amplification by sampling: fedge's
    round loop does not sample secretly), so the number of clients does not enter.
    """
    try:
        DPConfig(noise_multiplier=noise_multiplier, target_delta=delta)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if rounds <= 0:
        raise typer.BadParameter(f"--rounds must be > 0, got {rounds}")
    table = Table(title=f"z={noise_multiplier}, delta={delta}, one release per round")
    for column in ("round", "epsilon (RDP)", "epsilon (PLD)"):
        table.add_column(column)
    for r in range(1, rounds + 1):
        releases = [noise_multiplier] * r
        rdp, pld = (gaussian_epsilon(releases, delta, m) for m in ("rdp", "pld"))  # type: ignore[arg-type]
        table.add_row(str(r), f"{rdp:.3f}", f"{pld:.3f}")
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
