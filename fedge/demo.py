"""`fedge demo`: the main job end to end, each stage showing progress, results in one run directory.

zoo (build or reuse) -> federated LoRA fine-tuning with SecAgg + DP -> edge: int8 draft decoding
speculatively against the verifier serving the federated adapter -> one summary JSON.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from fedge.zoo import PRESETS, ZooPaths, build_zoo

SUMMARY_NAME = "demo_summary.json"


def card_table(zoo: ZooPaths) -> Table:
    """The model card's headline figures as a table."""
    card = zoo.card
    table = Table(title=f"model zoo '{card['preset']}' ({zoo.root})")
    for column in ("model", "parameters", "training tokens", "train s", "held-out ppl"):
        table.add_column(column)
    for role in ("target", "draft"):
        row = card[role]
        table.add_row(
            role,
            f"{row['parameters']:,}",
            f"{row['training_tokens']:,}",
            str(row.get("training_seconds")),
            f"{row['heldout_perplexity']:.1f}",
        )
    agreement = card["agreement"]
    table.caption = (
        f"draft greedy agreement {agreement['greedy_rate']:.1%}, "
        f"{agreement['tokens_per_verify_draft4']:.2f} tokens per verification at draft length 4"
    )
    return table


def run_demo(preset: str, out: Path | None, console: Console) -> dict[str, Any]:
    """Run every stage of the main job and return (and write) the summary."""
    from edge.demo import edge_stage
    from simulations.demo import federated_stage

    run_dir = out or Path("runs") / f"demo-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"preset": preset, "run_dir": str(run_dir), "stages": {}}
    started = time.perf_counter()

    console.rule("[bold]1/3 model zoo")
    zoo = build_zoo(preset, console=console)
    console.print(card_table(zoo))
    summary["stages"]["zoo"] = {"root": str(zoo.root), "card": zoo.card}

    console.rule("[bold]2/3 federated LoRA fine-tuning")
    adapter_dir = federated_stage(zoo, run_dir / "federation", console)
    summary["stages"]["federation"] = {"adapter_dir": str(adapter_dir)}

    console.rule("[bold]3/3 edge: speculative decoding against the verifier")
    summary["stages"]["edge"] = edge_stage(zoo, adapter_dir, run_dir / "edge", console)

    summary["seconds"] = round(time.perf_counter() - started, 1)
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str))
    console.print(f"[green]demo finished in {summary['seconds']} s; results in {run_dir}")
    return summary


def demo(
    preset: str = typer.Option("demo", help=f"Zoo preset, one of {sorted(PRESETS)}."),
    out: Path | None = typer.Option(None, help="Run directory (default: runs/demo-<time>)."),
) -> None:
    """Run the main job: zoo, federated fine-tuning with SecAgg + DP, edge speculative decoding."""
    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    run_demo(preset, out, Console())
