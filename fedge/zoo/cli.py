"""`fedge models ...`: build the zoo and show its model card."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from fedge.zoo.build import build_zoo
from fedge.zoo.presets import PRESETS

app = typer.Typer(help="Build and inspect the built-in model zoo.", no_args_is_help=True)


@app.command("build")
def build(
    preset: str = typer.Option("default", help=f"One of {sorted(PRESETS)}."),
    out: Path | None = typer.Option(
        None, help="Output directory (default: $FEDGE_HOME/zoo/PRESET)."
    ),
    seed: int = typer.Option(0, help="Seed for initialisation and batch order."),
    force: bool = typer.Option(False, help="Rebuild even when an intact zoo exists."),
) -> None:
    """Build (or resume, or reuse) a zoo preset and print its model card."""
    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    console = Console()
    paths = build_zoo(preset, out, seed=seed, force=force, console=console)
    console.print_json(json.dumps(paths.card))


@app.command("table")
def table(
    cards: list[Path] = typer.Argument(
        None, help="model_card.json files (default: every built preset under $FEDGE_HOME/zoo)."
    ),
    readme: Path | None = typer.Option(
        None, help="Rewrite the table between the zoo-table markers of this file."
    ),
) -> None:
    """Print the measured zoo table (Markdown) from model cards; optionally rewrite it in README."""
    from fedge.paths import fedge_home
    from fedge.zoo.table import render, replace_in

    if not cards:
        cards = sorted((fedge_home() / "zoo").glob("*/model_card.json"))
    if not cards:
        raise typer.BadParameter("no model cards found; build a zoo or pass card files")
    text = render(cards)
    if readme is not None:
        readme.write_text(replace_in(readme.read_text(), text))
    print(text)
