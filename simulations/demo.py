"""The federated stage of ``fedge demo``: a short federation on the zoo's target, perplexity before/after.

Runs the ``demo`` scenario (``simulations/scenarios/demo.toml``) on Flower's
simulation engine with the given zoo's target model on the natural partition.
Privacy plugs in by configuration: ``FEDGE_DEMO_SET`` holds space-separated
``key=value`` overrides (the keys of ``fedge simulate --set``), e.g. SecAgg+ with
distributed DP and a budget stop (names from ``server/privacy/factories.py``)::

    FEDGE_DEMO_SET="weighting=uniform aggregator=server.privacy.factories:secagg_distributed_dp
      client-mods=clients.privacy.mods:distributed_dp_mod,clients.secagg.mod:secaggplus_mod
      privacy-budget=server.privacy.factories:rdp_budget max-epsilon=8"
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedge.zoo import ZooPaths
from server.rundir import MetricsLog
from simulations.runner import load_scenario, run_simulation

DEMO_SCENARIO = "demo"
DEMO_OVERRIDES_ENV = "FEDGE_DEMO_SET"


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


def federated_stage(zoo: ZooPaths, run_dir: Path, console: Console) -> Path:
    """Fine-tune LoRA adapters of ``zoo.target_dir`` federatedly; return the final peft adapter dir."""
    overrides: dict[str, Any] = {"model": str(zoo.target_dir), **demo_overrides()}
    scenario = load_scenario(DEMO_SCENARIO, overrides)
    cfg = scenario.config
    console.rule("[bold]federated LoRA fine-tuning")
    console.print(
        f"{scenario.num_supernodes} clients (natural partition: one stdlib package each), "
        f"{cfg.strategy}, {cfg.num_server_rounds} rounds, LoRA r={cfg.train.lora_r} on "
        f"{cfg.train.lora_target_modules}, aggregator {cfg.aggregator}"
    )
    with console.status("running the Flower simulation") as status:

        def on_row(row: Any) -> None:
            ppl = row.get("perplexity")
            status.update(
                f"round {row['round']}/{cfg.num_server_rounds}: perplexity {ppl:.2f}"
                if isinstance(ppl, float)
                else f"round {row['round']}"
            )

        outcome = run_simulation(scenario, run_dir, on_row=on_row)
    rows = MetricsLog(run_dir).rows()
    if outcome is None or outcome.status == "failed" or outcome.adapter_dir is None:
        message = outcome.message if outcome is not None else "the ServerApp did not finish"
        raise RuntimeError(f"federated stage failed: {message} (run dir {run_dir})")
    ok = [r for r in rows if r.get("perplexity") is not None]
    before, after = ok[0]["perplexity"], ok[-1]["perplexity"]
    table = Table("held-out perplexity", "value")
    table.add_row("base model (round 0)", f"{before:.2f}")
    table.add_row(f"global adapter (round {ok[-1]['round']})", f"{after:.2f}")
    table.add_row("change", f"{(after - before) / before:+.1%}")
    console.print(table)
    console.print(f"adapter: {outcome.adapter_dir}  merged: {run_dir / 'final' / 'merged'}")
    return Path(outcome.adapter_dir)
