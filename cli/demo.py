"""`fedge demo`: the main job end to end, each stage showing progress, results in one run directory.

zoo card -> federated LoRA fine-tuning (plain, then SecAgg+ with DP) -> private learning at
population scale (500 simulated phones, cohorts of 50, plain and SecAgg+ with DP) -> draft
realigned to the federated target through the same federation -> edge: the realigned quantized draft decoding
speculatively against the verifier serving the federated adapter -> report.md with plots,
demo_summary.json, and TensorBoard round metrics under the run directory.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from fedge.tables import wrapping_table
from fedge.zoo import PRESETS, ZooPaths, build_zoo

SUMMARY_NAME = "demo_summary.json"


def card_table(zoo: ZooPaths) -> Table:
    """The model card's headline figures as a table."""
    card = zoo.card
    table = wrapping_table(
        f"model zoo '{card['preset']}' ({zoo.root})",
        ("model", "parameters", "training tokens", "train s", "held-out ppl"),
    )
    for role in ("target", "draft"):
        row = card[role]
        own = f" ({row['own_parameters']:,} own)" if "own_parameters" in row else ""
        table.add_row(
            role,
            f"{row['parameters']:,}{own}",
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


def quiet_libraries() -> None:
    """Silence framework logs, library warnings and progress bars (`--verbose` keeps them)."""
    from fedge.simulations.runner import QUIET_ENV

    os.environ[QUIET_ENV] = "1"  # Ray workers' logs stay off the console
    os.environ.setdefault("FLWR_LOG_LEVEL", "WARNING")
    os.environ["PYTHONWARNINGS"] = "ignore"  # inherited by Ray's worker processes
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"  # flwr-datasets' partitioners draw tqdm bars
    _disable_imported_tqdm()
    os.environ["RAY_DEDUP_LOGS"] = "1"
    warnings.filterwarnings("ignore")
    for name in ("flwr", "ray", "transformers", "torch", "onnxruntime", "root", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    from flwr.supercore.logger import update_console_handler
    from transformers.utils import logging as hf_logging

    update_console_handler(level="WARNING", timestamps=False, colored=True)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # datasets is optional for the demo
        pass


def _disable_imported_tqdm() -> None:
    """tqdm reads TQDM_DISABLE when it is imported; in this process it already was."""
    import functools

    import tqdm

    tqdm.tqdm.__init__ = functools.partialmethod(tqdm.tqdm.__init__, disable=True)  # type: ignore[method-assign]


def run_demo(preset: str, out: Path | None, console: Console, engine: str = "") -> dict[str, Any]:
    """Run every stage of the main job and return (and write) the summary.

    `engine` replaces the demo scenario's simulation engine ("ray" or "inprocess").
    """
    from fedge.edge.demo import edge_stage, showcase_view
    from fedge.simulations.demo import federated_stage, perplexity_table, realignment_stage
    from fedge.simulations.demo_population import population_stage
    from fedge.simulations.report import write_report

    run_dir = out or Path("runs") / f"demo-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"preset": preset, "run_dir": str(run_dir), "stages": {}}
    started = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(stage: str, since: float) -> float:
        timings[stage] = round(time.perf_counter() - since, 1)
        return time.perf_counter()

    console.rule("[bold]1/6 model zoo")
    tick = time.perf_counter()
    zoo = build_zoo(preset, console=console)
    console.print(card_table(zoo))
    summary["stages"]["zoo"] = {"root": str(zoo.root), "card": zoo.card}
    tick = lap("zoo", tick)

    console.rule("[bold]2/6 federated LoRA fine-tuning")
    plain = federated_stage(zoo, run_dir / "federation", console, engine=engine)
    tick = lap("federation", tick)

    console.rule("[bold]3/6 the same federation under SecAgg+ and distributed DP")
    private = federated_stage(
        zoo, run_dir / "federation-private", console, private=True, engine=engine
    )
    console.print(perplexity_table([plain, private]))
    summary["stages"]["federation"] = {"plain": plain.as_dict(), "private": private.as_dict()}
    tick = lap("federation_private", tick)

    console.rule("[bold]4/6 private learning at population scale: simulated phones, large cohorts")
    summary["stages"]["population"] = population_stage(
        str(zoo.target_dir), run_dir / "population", console
    )
    tick = lap("population", tick)

    console.rule("[bold]5/6 realigning the draft to the federated target")
    realigned_dir, acceptance = realignment_stage(
        zoo, plain, run_dir / "realign-draft", console, engine
    )
    summary["stages"]["realignment"] = {
        "draft_dir": str(realigned_dir),
        "clients": [r.as_row() for r in acceptance],
    }
    tick = lap("realignment", tick)

    console.rule(
        "[bold]6/6 edge: the realigned draft on ONNX Runtime, decoding against the verifier"
    )
    summary["stages"]["edge"] = edge_stage(
        zoo.target_dir, realigned_dir, plain.adapter_dir, run_dir / "edge", console
    )
    lap("edge", tick)

    summary["timings_s"] = timings
    summary["seconds"] = round(time.perf_counter() - started, 1)
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str))
    report = write_report(summary, run_dir)
    console.print(
        f"[green]demo finished in {summary['seconds']} s; report {report}; "
        f"`tensorboard --logdir {run_dir}`"
    )
    console.rule("[bold]the federated target and the realigned draft on held-out code")
    console.print(showcase_view(summary["stages"]["edge"]))  # the demo ends on readable code
    return summary


def demo(
    preset: str = typer.Option("demo", help=f"Zoo preset, one of {sorted(PRESETS)}."),
    out: Path | None = typer.Option(None, help="Run directory (default: runs/demo-<time>)."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Show framework logs, library warnings and progress bars."
    ),
    engine: str = typer.Option(
        "", help="Simulation engine: ray (Flower's) or inprocess; default: the scenario's (ray)."
    ),
) -> None:
    """Run the main job: zoo, federated fine-tuning (plain, SecAgg+ with DP), private learning on
    500 simulated phones, draft realignment, edge."""
    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if engine not in ("", "ray", "inprocess"):
        raise typer.BadParameter(f"unknown engine {engine!r}; choose ray or inprocess")
    if not verbose:
        quiet_libraries()
    run_demo(preset, out, Console(), engine)
