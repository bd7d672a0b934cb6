"""The federated stages of ``fedge demo``: fine-tune the target, the same under SecAgg+ and DP, realign the draft.

Runs the ``demo`` scenario (``simulations/scenarios/demo.toml``: the demo zoo's target, one
client per stdlib package, every client in every round) on Flower's simulation engine.
Perplexity is reported twice: on the participating clients' own held-out code (what the
federation is for) and on the whole corpus's held-out code (every package, most of which no
client holds). The private run adds SecAgg+ with distributed DP (``PRIVATE_OVERRIDES``) and
reports its epsilon and what it costs in perplexity. Each federation's ServerApp writes its
round metrics to TensorBoard under its own run directory (``tensorboard --logdir <run>``). ``FEDGE_DEMO_SET`` holds space-separated ``key=value``
overrides for every run (the keys of ``fedge simulate --set``).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from fedge.server.rundir import MetricsLog
from fedge.simulations.realign import (
    PROMPT_TOKENS,
    REALIGN_OVERRIDES,
    ClientAcceptance,
    acceptance_by_client,
    participating,
    realign_draft,
)
from fedge.simulations.runner import Scenario, load_scenario, run_simulation
from fedge.tables import wrapping_table
from fedge.zoo import ZooPaths

DEMO_SCENARIO = "demo"
DEMO_OVERRIDES_ENV = "FEDGE_DEMO_SET"
# The draft's realignment budget: the federation's lr of 0.01 overshoots a 1-layer draft's
# distillation. Against this demo's federated target (5 clients x 12 prompts; base draft vs base
# target 57.5%, vs federated target 49.5%): rank 16, lr 0.005, 24 steps 62.4%; rank 32 64.6%
# in the same time; 48 steps 65.6% at 1.4x the time.
DEMO_REALIGN_OVERRIDES: dict[str, Any] = {
    **REALIGN_OVERRIDES,
    "lora-r": 32,
    "lora-alpha": 64,
    "lr": 0.005,
    "local-steps": 24,
}
ACCEPTANCE_PROMPTS = 12  # per client: 6 x 32 tokens left the per-client figures +-5 points noisy
PRIVATE_OVERRIDES: dict[str, Any] = {  # SecAgg+ with distributed DP, RDP accounting
    "aggregator": "fedge.server.privacy.factories:secagg_distributed_dp",
    "privacy-budget": "fedge.server.privacy.factories:rdp_budget",
    "weighting": "uniform",
    "dp-clip-norm": 0.1,
    "dp-noise-multiplier": 0.5,
    "dp-min-survival": 0.75,
}


@dataclass(frozen=True)
class FederationResult:
    """What one federation produced and how much it moved perplexity."""

    label: str
    run_dir: Path
    adapter_dir: Path
    merged_dir: Path
    partitions: list[int]  # clients seen training (none under SecAgg+: metrics are masked sums)
    clients: int  # most client updates aggregated in one round (what SecAgg+ lets the server see)
    participating_before: float  # server's perplexity on the participants' held-out code, round 0
    participating_after: float  # ... after the last round
    corpus_before: float  # server's whole-corpus held-out perplexity, round 0
    corpus_after: float  # ... after the last round
    epsilon: float | None  # privacy spent (None without DP)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "label": self.label,
            "run_dir": str(self.run_dir),
            "adapter_dir": str(self.adapter_dir),
            "partitions": self.partitions,
            "clients": self.clients,
            "participating_perplexity": [self.participating_before, self.participating_after],
            "corpus_perplexity": [self.corpus_before, self.corpus_after],
            "epsilon": self.epsilon,
        }


def demo_overrides(extra: str | None = None) -> dict[str, str]:
    """Parse space-separated ``key=value`` overrides (from ``FEDGE_DEMO_SET`` by default)."""
    text = os.environ.get(DEMO_OVERRIDES_ENV, "") if extra is None else extra
    out: dict[str, str] = {}
    for item in shlex.split(text):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{DEMO_OVERRIDES_ENV} entry {item!r} must be key=value")
        out[key] = value
    return out


def demo_scenario(
    zoo: ZooPaths | Path,
    private: bool = False,
    engine: str = "",
    scenario_name: str = DEMO_SCENARIO,
    private_overrides: Mapping[str, Any] | None = None,
) -> Scenario:
    """The demo scenario on `zoo`'s target (or a target folder), optionally with SecAgg+ and
    distributed DP (`private_overrides`, default PRIVATE_OVERRIDES).

    `engine` replaces the scenario's engine ("ray": Flower's simulation, "inprocess").
    """
    target = zoo if isinstance(zoo, Path) else zoo.target_dir
    overrides: dict[str, Any] = {"model": str(target), "save-merged": True}
    if private:
        overrides.update(PRIVATE_OVERRIDES if private_overrides is None else private_overrides)
    scenario = load_scenario(scenario_name, {**overrides, **demo_overrides()})
    return replace(scenario, engine=engine) if engine else scenario


def federated_stage(
    zoo: ZooPaths | Path,
    run_dir: Path,
    console: Console,
    private: bool = False,
    engine: str = "",
    scenario_name: str = DEMO_SCENARIO,
    private_overrides: Mapping[str, Any] | None = None,
) -> FederationResult:
    """Fine-tune LoRA adapters of the zoo's target (or a target folder) federatedly on the
    scenario `scenario_name`; report perplexity both ways."""
    scenario = demo_scenario(zoo, private, engine, scenario_name, private_overrides)
    cfg = scenario.config
    label = "secagg+dp" if private else "plain"
    data = "code instructions of" if cfg.data_kind == "instructions" else "the code of"
    console.print(
        f"{scenario.num_supernodes} clients ({data} one stdlib package each), "
        f"{scenario.engine} engine, "
        f"{cfg.strategy}, "
        f"{cfg.num_server_rounds} rounds, LoRA r={cfg.train.lora_r}, aggregator {cfg.aggregator}"
    )
    _run(scenario, run_dir, console, f"federation ({label})")
    rows = [r for r in MetricsLog(run_dir).rows() if r.get("perplexity") is not None]
    epsilon = rows[-1].get("epsilon")
    result = FederationResult(
        label,
        run_dir,
        run_dir / "final" / "adapter",
        run_dir / "final" / "merged",
        participating(run_dir),
        max(int(r.get("clients_succeeded") or 0) for r in rows),
        rows[0]["participants_perplexity"],
        rows[-1]["participants_perplexity"],
        rows[0]["perplexity"],
        rows[-1]["perplexity"],
        float(epsilon) if private and isinstance(epsilon, (int, float)) else None,
    )
    console.print(perplexity_table([result]))
    return result


def perplexity_table(results: list[FederationResult]) -> Table:
    """Before/after perplexity per federation, on the clients' data and on the whole corpus."""
    table = wrapping_table(
        "held-out perplexity: base model -> federated adapter",
        ("federation", "participating clients' code", "whole corpus", "epsilon"),
    )
    for r in results:
        table.add_row(
            r.label,
            _change(r.participating_before, r.participating_after),
            _change(r.corpus_before, r.corpus_after),
            f"{r.epsilon:.2f}" if r.epsilon is not None else "-",
        )
    return table


def realignment_stage(
    zoo: ZooPaths, federation: FederationResult, run_dir: Path, console: Console, engine: str = ""
) -> tuple[Path, list[ClientAcceptance]]:
    """Realign the draft to the federated target through the same federation; measure it per client."""
    scenario = demo_scenario(zoo, engine=engine)
    console.print(
        f"the same {scenario.num_supernodes} clients distil the draft's LoRA adapter from the "
        "federated target's greedy continuations of their own code"
    )
    merged = _run(
        scenario,
        run_dir,
        console,
        "draft realignment",
        teacher=federation.merged_dir,
        draft=zoo.draft_dir,
    )
    models = {
        "base_target": zoo.target_dir,
        "federated_target": federation.merged_dir,
        "base_draft": zoo.draft_dir,
        "realigned_draft": merged,
    }
    with console.status("measuring acceptance on each client's held-out prompts"):
        rows = acceptance_by_client(
            scenario.config, federation.partitions, models, prompts=ACCEPTANCE_PROMPTS
        )
    console.print(acceptance_table(rows))
    return merged, rows


def acceptance_table(rows: list[ClientAcceptance]) -> Table:
    """Greedy agreement of the draft with the target per client, before and after realignment."""
    table = wrapping_table(
        "draft acceptance (greedy agreement) on each client's held-out prompts",
        (
            "client",
            "base draft / base target",
            "base draft / fed. target",
            "realigned / fed. target",
        ),
    )
    for r in rows:
        if r.measured:
            rates = (f"{r.base:.1%}", f"{r.drifted:.1%}", f"{r.realigned:.1%}")
            label = str(r.partition) if r.prompt_tokens == PROMPT_TOKENS else f"{r.partition} *"
        else:
            rates, label = ("n/a", "n/a", "n/a"), str(r.partition)
        table.add_row(label, *rates)
    measured = [r for r in rows if r.measured] or rows
    mean = [
        float(np.mean([getattr(r, k) for r in measured])) for k in ("base", "drifted", "realigned")
    ]
    table.add_row("mean", *(f"{m:.1%}" for m in mean))
    notes = []
    if any(r.measured and r.prompt_tokens != PROMPT_TOKENS for r in rows):
        notes.append(f"* prompts shorter than {PROMPT_TOKENS} tokens (short held-out code)")
    if not all(r.measured for r in rows):
        notes.append("n/a: held-out code too short to measure")
    table.caption = "; ".join(notes) or None
    return table


def _run(
    scenario: Scenario,
    run_dir: Path,
    console: Console,
    what: str,
    teacher: Path | None = None,
    draft: Path | None = None,
) -> Path:
    """Run one federation (a realignment when `teacher` is given), showing each round's figure."""
    rounds = scenario.config.num_server_rounds
    with console.status(f"{what}: starting the Flower simulation") as status:

        def on_row(row: Mapping[str, Any]) -> None:
            ppl = row.get("perplexity")
            shown = f"perplexity {ppl:.2f}" if isinstance(ppl, float) else str(row.get("status"))
            status.update(f"{what}: round {row['round']}/{rounds}, {shown}")

        if teacher is not None and draft is not None:
            return realign_draft(
                scenario, draft, teacher, run_dir, on_row=on_row, overrides=DEMO_REALIGN_OVERRIDES
            )
        outcome = run_simulation(scenario, run_dir, on_row=on_row)
    if outcome is None or outcome.status == "failed" or outcome.adapter_dir is None:
        message = outcome.message if outcome is not None else "the ServerApp did not finish"
        raise RuntimeError(f"{what} failed: {message} (run dir {run_dir})")
    return Path(outcome.adapter_dir)


def _change(before: float, after: float) -> str:
    return f"{before:.2f} -> {after:.2f} ({(after - before) / before:+.1%})"
