"""`fedge demo`: the main job end to end, each stage showing progress, results in one run directory.

zoo card -> federated LoRA fine-tuning (plain, then SecAgg+ with DP) -> private learning at
population scale (500 simulated phones, cohorts of 50, plain and SecAgg+ with DP) -> draft
realigned to the federated target through the same federation -> edge: the realigned quantized draft decoding
speculatively against the verifier serving the federated adapter -> report.md with plots,
demo_summary.json, and TensorBoard round metrics under the run directory.

`fedge demo --preset smollm2` runs a pretrained model through the same stages instead
(`run_pretrained_demo`; its sizes in `fedge.simulations.demo_presets`): fetch (cached) -> draft
(cached; built within a budget when missing) -> federated LoRA on code instructions, plain and
under SecAgg+ with DP -> realignment (or why it is skipped) -> edge, ending on a held-out
instruction's completion beside the true body.
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

from fedge.simulations.demo_presets import PRETRAINED_DEMOS, PretrainedDemo
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


def run_pretrained_demo(
    demo: PretrainedDemo,
    out: Path | None,
    console: Console,
    engine: str = "",
    draft: Path | None = None,
    model: Path | None = None,
) -> dict[str, Any]:
    """Run a pretrained model through every stage (`demo`'s sizes); return (and write) the summary.

    `model` / `draft` use those folders instead of the fetched model and its cached draft
    (default ``$FEDGE_HOME/models/<model>`` and ``...-draft``, as `fedge models` makes them).
    """
    from fedge.data.instructions import heldout_prompts
    from fedge.edge.demo import edge_stage, showcase_view
    from fedge.models import load_tokenizer
    from fedge.pretrained.fetch import fetch_model, model_dir
    from fedge.simulations.demo import federated_stage, perplexity_table
    from fedge.simulations.report import write_pretrained_report

    run_dir = out or Path("runs") / f"demo-{demo.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"preset": demo.name, "run_dir": str(run_dir), "stages": {}}
    started = time.perf_counter()
    timings: dict[str, float] = {}
    load = [round(os.getloadavg()[0], 2)]

    def lap(stage: str, since: float) -> float:
        timings[stage] = round(time.perf_counter() - since, 1)
        return time.perf_counter()

    console.rule(f"[bold]1/5 the pretrained model: {demo.model}")
    tick = time.perf_counter()
    if model is None:
        with console.status(f"fetching {demo.model} (kept when already converted)"):
            model, record = fetch_model(demo.model)
    else:
        record = {}
    console.print(
        f"{model}: {record.get('parameters', '?'):,} parameters" if record else str(model)
    )
    summary["stages"]["model"] = {"dir": str(model), "manifest": record}
    tick = lap("model", tick)

    console.rule("[bold]2/5 the draft")
    draft = draft or model_dir(f"{demo.model}-draft")
    summary["stages"]["draft"] = _ensure_draft(model, draft, demo.draft_minutes, console)
    tick = lap("draft", tick)

    console.rule("[bold]3/5 federated LoRA fine-tuning on code instructions")
    plain = federated_stage(
        model, run_dir / "federation", console, engine=engine, scenario_name=demo.scenario
    )
    tick = lap("federation", tick)

    console.rule("[bold]4/5 the same federation under SecAgg+ and distributed DP")
    private = federated_stage(
        model,
        run_dir / "federation-private",
        console,
        private=True,
        engine=engine,
        scenario_name=demo.scenario,
        private_overrides=demo.private,
    )
    console.print(perplexity_table([plain, private]))
    summary["stages"]["federation"] = {
        "plain": plain.as_dict(),
        "private": private.as_dict(),
        "private_cost": _private_cost(plain, private),
    }
    tick = lap("federation_private", tick)
    if demo.realign_skipped:
        console.print(f"[yellow]draft realignment skipped:[/yellow] {demo.realign_skipped}")
        summary["stages"]["realignment"] = {"skipped": demo.realign_skipped}

    console.rule("[bold]5/5 edge: the draft decoding speculatively against the verifier")
    tokenizer = load_tokenizer(model)
    sizes = demo.edge
    with console.status("picking held-out instructions"):
        examples = heldout_prompts(
            tokenizer,
            sizes.validation_prompts + sizes.prompts,
            demo.max_instruction_tokens,
            sizes.new_tokens,
        )
    pairs = [(e.prompt_ids, e.response_ids) for e in examples]
    edge = edge_stage(model, draft, plain.adapter_dir, run_dir / "edge", console, sizes, pairs)
    shown = edge["showcase"]  # the instruction as written, not its chat-template rendering
    for e in examples:
        if tokenizer.decode(e.prompt_ids, skip_special_tokens=True) == shown["prompt"]:
            shown.update(prompt=e.instruction, instruction=True)
    summary["stages"]["edge"] = edge
    lap("edge", tick)

    load.append(round(os.getloadavg()[0], 2))
    summary["timings_s"] = timings
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["load_average"] = load
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str))
    report = write_pretrained_report(summary, run_dir)
    console.print(f"[green]demo finished in {summary['seconds']} s; report {report}")
    console.rule("[bold]a held-out instruction: the federated target's completion beside its body")
    console.print(showcase_view(edge))
    return summary


def _ensure_draft(target: Path, draft: Path, minutes: float, console: Console) -> dict[str, Any]:
    """The draft's card: the cached one, or a build (resumed where one was cut off) in `minutes`."""
    from fedge.zoo.draft import CARD_NAME, WORK_DIR, build_draft

    card_path = draft / CARD_NAME
    finished = card_path.is_file() or not (draft / WORK_DIR).is_dir()
    if (draft / "config.json").is_file() and finished:  # a build cut off midway is resumed
        card: dict[str, Any] = json.loads(card_path.read_text()) if card_path.is_file() else {}
        console.print(
            f"cached draft {draft}: greedy agreement {card.get('greedy_agreement', '?')} after "
            f"{card.get('training_seconds', '?')} s of distillation"
        )
        return {"dir": str(draft), "cached": True, "card": card}
    with console.status(f"building the draft into {draft} (budget {minutes:g} min)") as status:

        def show(point: dict[str, Any]) -> None:
            status.update(
                f"draft: step {point['step']} ({point['seconds']} s), greedy agreement "
                f"{point['greedy_agreement']}"
            )

        card = build_draft(target, draft, minutes=minutes, resume=True, progress=show)
    console.print(f"draft built: greedy agreement {card.get('greedy_agreement')}")
    return {"dir": str(draft), "cached": False, "card": card}


def _private_cost(plain: Any, private: Any) -> dict[str, Any]:
    """What SecAgg+ with distributed DP cost against the plain run, in participants' perplexity."""
    before, after_plain, after_private = (
        plain.participating_before,
        plain.participating_after,
        private.participating_after,
    )
    return {
        "epsilon": private.epsilon,
        "plain_change": round((after_plain - before) / before, 4),
        "private_change": round((after_private - before) / before, 4),
        "perplexity_gap": round(after_private - after_plain, 4),
    }


def demo(
    preset: str = typer.Option(
        "demo",
        help=f"Zoo preset, one of {sorted(PRESETS)}, or a pretrained-model demo: "
        f"{sorted(PRETRAINED_DEMOS)}.",
    ),
    out: Path | None = typer.Option(None, help="Run directory (default: runs/demo-<time>)."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Show framework logs, library warnings and progress bars."
    ),
    engine: str = typer.Option(
        "", help="Simulation engine: ray (Flower's) or inprocess; default: the scenario's (ray)."
    ),
    draft: Path | None = typer.Option(
        None,
        help="Pretrained presets: this draft folder (default: $FEDGE_HOME/models/MODEL-draft).",
    ),
) -> None:
    """Run the main job: zoo, federated fine-tuning (plain, SecAgg+ with DP), private learning on
    500 simulated phones, draft realignment, edge."""
    if preset not in PRESETS and preset not in PRETRAINED_DEMOS:
        choices = sorted(PRESETS) + sorted(PRETRAINED_DEMOS)
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {choices}")
    if engine not in ("", "ray", "inprocess"):
        raise typer.BadParameter(f"unknown engine {engine!r}; choose ray or inprocess")
    if not verbose:
        quiet_libraries()
    if preset in PRETRAINED_DEMOS:
        run_pretrained_demo(PRETRAINED_DEMOS[preset], out, Console(), engine, draft)
    else:
        run_demo(preset, out, Console(), engine)
