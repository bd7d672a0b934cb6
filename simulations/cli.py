"""``fedge simulate``: run a scenario's federation on a simulation engine, with rich progress."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedge.server.rundir import MetricsLog, plot_perplexity
from fedge.simulations.runner import Scenario, load_run_scenario, load_scenario, run_simulation

app = typer.Typer(
    help="Run the federation in simulation (Flower's Ray engine or the in-process engine).",
    no_args_is_help=False,
    context_settings={"allow_interspersed_args": True},  # options may follow the SCENARIO argument
)


def parse_sets(items: list[str]) -> dict[str, str]:
    """Parse repeated ``--set key=value`` options (values are typed by the config fields)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _env() -> None:
    """Offline, quiet defaults for Flower and Hugging Face (a user's own values win)."""
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("FLWR_TELEMETRY_ENABLED", "0"),
        ("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(key, value)


@app.callback(invoke_without_command=True)
def simulate(
    scenario: Annotated[
        str, typer.Argument(help="Scenario name in simulations/scenarios or a .toml path.")
    ] = "quick",
    strategy: Annotated[
        str | None,
        typer.Option(help="fedavg | fedprox | scaffold; comma-separated to compare strategies."),
    ] = None,
    rounds: Annotated[int | None, typer.Option(help="Number of server rounds.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (default runs/<scenario>-<time>).")
    ] = None,
    resume: Annotated[Path | None, typer.Option(help="Continue the run in this directory.")] = None,
    num_supernodes: Annotated[int | None, typer.Option(help="Simulated clients.")] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="ray (Flower's simulation engine) | inprocess (no Ray: large populations, "
            "small workloads on one machine)."
        ),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key: key=value.")
    ] = None,
) -> None:
    """Run a federated LoRA fine-tuning scenario and write its run directory."""
    _env()
    console = Console()
    overrides: dict[str, Any] = parse_sets(set_ or [])
    if rounds is not None:
        overrides["num-server-rounds"] = rounds
    population: dict[str, Any] = {"num-supernodes": num_supernodes} if num_supernodes else {}
    if engine is not None:
        population["engine"] = engine
    try:
        if resume is not None:
            if num_supernodes:
                raise typer.BadParameter("--num-supernodes cannot change on --resume")
            loaded = load_run_scenario(resume, overrides)
            if engine is not None:
                loaded = dataclasses.replace(loaded, engine=engine)
            code = _run_one(loaded, resume, True, console)
            raise typer.Exit(code)
        strategies = [s.strip() for s in (strategy or "").split(",") if s.strip()]
        if not strategies:  # the scenario may name strategies to compare (phones: all three)
            default = load_scenario(scenario, overrides, population).strategies
            strategies = [s.strip() for s in default.split(",") if s.strip()]
        base = out or Path("runs") / f"{scenario}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
        if len(strategies) <= 1:
            if strategies:
                overrides["strategy"] = strategies[0]
            code = _run_one(load_scenario(scenario, overrides, population), base, False, console)
            raise typer.Exit(code)
        codes = [
            _run_one(
                load_scenario(scenario, {**overrides, "strategy": s}, population),
                base / s,
                False,
                console,
            )
            for s in strategies
        ]
        plot = plot_perplexity(
            {s: MetricsLog(base / s).rows() for s in strategies}, base / "perplexity_compare.png"
        )
        console.print(f"comparison plot: {plot}")
        _compare_devices(base, strategies, console)
        raise typer.Exit(max(codes))
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def _run_one(scenario: Scenario, run_dir: Path, resume: bool, console: Console) -> int:
    """Run one scenario with a progress bar; print the summary; return the exit code."""
    cfg = scenario.config
    console.print(
        f"[bold]fedge simulate[/bold] {scenario.name}: {cfg.strategy}, {cfg.num_server_rounds} rounds, "
        f"{scenario.num_supernodes} clients, model {cfg.model} -> {run_dir}"
    )
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(
            f"starting the {scenario.engine} engine", total=cfg.num_server_rounds
        )

        def on_row(row: Mapping[str, Any]) -> None:
            ppl = row.get("perplexity")
            ppl_text = f"{ppl:.2f}" if isinstance(ppl, float) else "-"
            progress.update(
                task,
                completed=int(row["round"]),
                description=f"round {row['round']} {row['status']}: perplexity {ppl_text}",
            )

        run_simulation(scenario, run_dir, resume=resume, on_row=on_row)
    return _report(run_dir, console)


def _compare_devices(base: Path, strategies: list[str], console: Console) -> None:
    """With simulated devices: perplexity against simulated hours, one line per strategy."""
    from fedge.simulations.devicesim.report import plot_perplexity_hours, read_rounds

    runs = {s: rows for s in strategies if (rows := read_rounds(base / s))}
    if not runs:
        return
    summaries = [base / s / "devices" / "summary.json" for s in runs]
    targets = [json.loads(p.read_text()).get("target_perplexity") for p in summaries if p.is_file()]
    target = max((float(t) for t in targets if t), default=0.0)
    plot = plot_perplexity_hours(runs, base / "perplexity_hours_compare.png", target)
    console.print(f"perplexity vs simulated hours: {plot}")


def _device_summary(run_dir: Path, console: Console) -> None:
    """One line about the simulated devices of a run, when it had any."""
    path = run_dir / "devices" / "summary.json"
    if not path.is_file():
        return
    s = json.loads(path.read_text())
    to_target = s["hours_to_target"]
    console.print(
        f"devices: {s['simulated_hours']:.2f} simulated h, trained {s['trained']:.0f} of "
        f"{s['selected']:.0f} selected ({s['partial']:.0f} partial); dropped offline "
        f"{s['dropped']['offline']:.0f}, deadline {s['dropped']['deadline']:.0f}, late "
        f"{s['dropped']['late']:.0f}; {s['excluded_memory']} excluded (memory); wasted "
        f"{100 * s['wasted_fraction']:.0f}% of compute; hours to target: "
        f"{'-' if to_target is None else f'{to_target:.2f}'}"
    )


def _report(run_dir: Path, console: Console) -> int:
    """Print the per-round table and the final status from the run directory."""
    status_file = run_dir / "status.json"
    status = (
        json.loads(status_file.read_text())
        if status_file.is_file()
        else {"status": "failed", "message": "the server did not start; see the log above"}
    )
    table = Table(
        "round", "status", "train loss", "perplexity", "clients ok/sampled", "MB up", "seconds"
    )
    for row in MetricsLog(run_dir).rows():
        ppl = row.get("perplexity")
        loss = row.get("train_loss")
        table.add_row(
            str(row["round"]),
            str(row["status"]),
            f"{loss:.3f}" if isinstance(loss, float) else "-",
            f"{ppl:.2f}" if isinstance(ppl, float) else "-",
            f"{row['clients_succeeded']}/{row['clients_sampled']}",
            f"{row['bytes_up'] / 1e6:.2f}",
            f"{row['round_seconds']:.1f}",
        )
    console.print(table)
    _device_summary(run_dir, console)
    colour = "green" if status["status"] in ("completed", "budget") else "red"
    console.print(f"[{colour}]{status['status']}[/{colour}]: {status['message']}")
    console.print(f"run directory: {run_dir}")
    return 0 if status["status"] in ("completed", "budget") else 1
