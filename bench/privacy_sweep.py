"""Privacy-utility sweep on the demo's federation: participants' held-out perplexity against epsilon.

The setting is the one where the demo's plain federation clearly improves
(``simulations/scenarios/demo.toml``: the demo zoo's target, one stdlib package per
client, all six clients every round, all linear layers at LoRA rank 16, lr 0.01, 20
local steps, 4 rounds); utility is the server's perplexity on the participating clients'
own held-out code (``participants_perplexity``), what that federation is for. Every run
uses uniform weighting and clip C = 0.1 (the demo's private run), delta 1e-5, RDP, no
sampling amplification (every client trains every round). Runs: plain, SecAgg+, central
DP and SecAgg+ with distributed DP at several noise multipliers, on the in-process engine
(one process, torch on every core; a 1-round warm-up run first loads the model and the
corpus). Each call runs the chosen runs only; the caller merges them with earlier ones
by run label, so the sweep can be split into short parts.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SCENARIO = "demo"
FACTORIES = "fedge.server.privacy.factories:"
COMMON: dict[str, Any] = {  # on top of the demo scenario's [config]
    "weighting": "uniform",
    "dp-clip-norm": 0.1,
    "client-eval": False,
    "save-merged": False,
}
BUDGET = {"privacy-budget": FACTORIES + "rdp_budget"}


def run_specs(
    baselines: Sequence[str], central: Sequence[float], distributed: Sequence[float]
) -> dict[str, tuple[float, dict[str, Any]]]:
    """Run label -> (noise multiplier, config overrides) for the runs asked for."""
    runs: dict[str, tuple[float, dict[str, Any]]] = {}
    if "plain" in baselines:
        runs["plain"] = (0.0, {})
    if "secagg" in baselines:
        runs["secagg"] = (0.0, {"aggregator": FACTORIES + "secagg"})
    for z in central:
        runs[f"central-dp z={z:g}"] = (
            z,
            {**BUDGET, "aggregator": FACTORIES + "central_dp", "dp-noise-multiplier": z},
        )
    for z in distributed:
        runs[f"secagg-ddp z={z:g}"] = (
            z,
            {
                **BUDGET,
                "aggregator": FACTORIES + "secagg_distributed_dp",
                "dp-noise-multiplier": z,
                "dp-min-survival": 1.0,  # every client answers: the sum carries exactly z
            },
        )
    return runs


def sweep(runs: Mapping[str, tuple[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run a 1-round warm-up, then each run on one in-process grid; one row per run."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from bench._common import loadavg
    from fedge.server.loop import run_federation
    from fedge.server.rundir import MetricsLog
    from fedge.simulations.apps import clientapp
    from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
    from fedge.simulations.runner import client_roots, load_scenario

    root = Path(tempfile.mkdtemp(prefix="fedge-privacy-sweep-"))
    all_runs = {"warm-up": (0.0, {"num-server-rounds": 1}), **runs}
    scenarios = {
        label: load_scenario(
            SCENARIO,
            {
                **COMMON,
                **extra,
                "run-dir": str(root / f"run{i}"),
                "client-state-dir": str(root / f"state{i}"),
            },
        )
        for i, (label, (_, extra)) in enumerate(all_runs.items())
    }
    rows: list[dict[str, Any]] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for label, scenario in scenarios.items():
            outcome = run_federation(grid, scenario.config)
            if label == "warm-up":
                continue
            history = [r for r in MetricsLog(outcome.run_dir).rows() if r.get("perplexity")]
            rounds_s = [float(r["round_seconds"]) for r in history if r["round"] > 0]
            z = all_runs[label][0]
            rows.append(
                {
                    "run": label,
                    "noise_multiplier": z,
                    "epsilon": round(float(history[-1]["epsilon"]), 3) if z > 0 else None,
                    "participants_perplexity": [
                        round(float(history[0]["participants_perplexity"]), 3),
                        round(float(history[-1]["participants_perplexity"]), 3),
                    ],
                    "corpus_perplexity": [
                        round(float(history[0]["perplexity"]), 3),
                        round(float(history[-1]["perplexity"]), 3),
                    ],
                    "round_seconds": round(float(np.mean(rounds_s)), 3),
                    "status": outcome.status,
                    "loadavg": loadavg(),
                }
            )
            print(f"sweep {label}: {rows[-1]}", flush=True)

    size = scenarios["warm-up"].num_supernodes
    with (
        tempfile.TemporaryDirectory(prefix="fedge-sweep-nodes-") as state,
        client_roots(scenarios["warm-up"].config),  # every run's state dir is under `root`
    ):
        run_inprocess(server_app, InProcessGrid(clientapp, DeviceTable(size), Path(state)))
    return rows


def plot(points: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """Participants' final held-out perplexity against epsilon (log axis), baselines as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedge.server.privacy.plots import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, label, marker in (
        ("central-dp", "central DP", "o"),
        ("secagg-ddp", "SecAgg+ with distributed DP", "s"),
    ):
        pts = sorted(
            (p["epsilon"], p["participants_perplexity"][1])
            for p in points
            if p["run"].startswith(prefix) and p["epsilon"]
        )
        if pts:
            ax.plot([e for e, _ in pts], [v for _, v in pts], marker=marker, label=label)
    styles = {"plain": ("tab:green", "--"), "secagg": ("tab:olive", ":")}
    for p in points:
        if p["run"] in styles:
            color, dash = styles[p["run"]]
            final = p["participants_perplexity"][1]
            ax.axhline(final, color=color, ls=dash, label=f"{p['run']} (no DP): {final:.2f}")
    if points:
        base = points[0]["participants_perplexity"][0]
        ax.axhline(base, color="grey", ls="-.", label=f"base model: {base:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (user level, delta 1e-5, RDP)")
    ax.set_ylabel("participants' held-out perplexity after 4 rounds")
    ax.set_title("Privacy-utility, demo federation (6 clients, natural partitions)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, out)
