"""Federated throughput: our cached ClientApp vs a reference that rebuilds the model per call.

Both run the same federation (N clients per round, all sampled, same local work) on
Flower's simulation engine, one after the other in this run, each in its own process.
Per round, from the run's metrics:

* compute   = sum of the clients' pure training time (inside the local loop) / concurrency
* overhead  = (train-phase wall time - compute) / compute   (framework, transport, model loads)
* updates/s = clients that replied / train-phase wall time

Prints one JSON object as the last line and writes it to bench/results/fl_throughput.json.
Usage: python bench/fl_throughput.py [--preset default|demo|micro] [--clients 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "fl_throughput.json"
APPS = {"ours": "fedge.simulations.apps:clientapp", "reference": "fedge.clients.reference:app"}


def _largest_existing_preset() -> str:
    """The largest zoo preset already built on this machine (this benchmark never builds one)."""
    from fedge.paths import zoo_dir

    for preset in ("default", "demo", "micro"):
        if (zoo_dir(preset) / "target" / "config.json").is_file():
            return preset
    raise SystemExit("no zoo preset is built here; run `fedge models build --preset micro` first")


def _run_variant(args: argparse.Namespace) -> None:
    """Child process: run one federation with the named ClientApp and exit."""
    import importlib

    from fedge.server.config import RunConfig
    from fedge.simulations.runner import Scenario, run_simulation

    module, _, attr = APPS[args.variant].partition(":")
    client_app = getattr(importlib.import_module(module), attr)
    cfg = RunConfig.from_mapping(
        {
            "model": args.model,
            "num-server-rounds": args.rounds,
            "min-train-nodes": args.clients,
            "min-available-nodes": args.clients,
            "max-chars-per-client": 20000,
            "local-steps": args.local_steps,
            "batch-size": args.batch_size,
            "seq-len": args.seq_len,
            "client-eval": False,
            "server-eval-batches": 2,
            "save-merged": False,
        }
    )
    scenario = Scenario("bench", "throughput", args.clients, 1.0, 0.0, cfg)
    outcome = run_simulation(scenario, Path(args.out), client_app=client_app)
    if outcome is None or outcome.status != "completed":
        raise SystemExit(f"{args.variant} run failed: {outcome and outcome.message}")


def _summarise(run_dir: Path, concurrency: int) -> dict[str, Any]:
    """Per-variant figures from metrics.jsonl (all rounds, and steady state = rounds >= 2)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["round"] >= 1 and r["status"] == "ok"]

    def figures(sel: list[dict[str, Any]]) -> dict[str, float]:
        wall = sum(r["train_phase_seconds"] for r in sel)
        compute = sum(r["train_seconds_sum"] for r in sel) / concurrency
        updates = sum(r["clients_succeeded"] for r in sel)
        return {
            "updates_per_s": round(updates / wall, 4),
            "train_phase_s": round(wall, 3),
            "compute_s": round(compute, 3),
            "overhead_over_compute": round((wall - compute) / compute, 4),
        }

    return {
        "all_rounds": figures(trained),
        "steady_rounds": figures(trained[1:]) if len(trained) > 1 else figures(trained),
        "model_loads_max": max(r["model_loads_max"] for r in trained),
        "rounds": len(trained),
    }


def main() -> None:
    """Parse options; as the parent, run both variants and report; as a child, run one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default=None, help="zoo preset (default: the largest built one)"
    )
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--variant", choices=sorted(APPS), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("FLWR_TELEMETRY_ENABLED", "0"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(key, value)
    if args.variant:
        _run_variant(args)
        return

    from fedge.zoo import ensure_zoo

    preset = args.preset or _largest_existing_preset()
    model = str(ensure_zoo(preset).target_dir)
    concurrency = max(1, min(args.clients, os.cpu_count() or 1))
    result: dict[str, Any] = {
        "benchmark": "fl_throughput",
        "preset": preset,
        "clients_per_round": args.clients,
        "local_steps": args.local_steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "concurrency": concurrency,
    }
    with tempfile.TemporaryDirectory(prefix="fedge-bench-") as tmp:
        for variant in ("ours", "reference"):
            out = Path(tmp) / variant
            cmd = [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--model",
                model,
                "--out",
                str(out),
            ]
            cmd += [
                "--clients",
                str(args.clients),
                "--rounds",
                str(args.rounds),
                "--local-steps",
                str(args.local_steps),
            ]
            cmd += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
            subprocess.run(
                cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            result[variant] = _summarise(out, concurrency)
    ours, ref = result["ours"]["steady_rounds"], result["reference"]["steady_rounds"]
    result["updates_per_s_ratio_ours_over_reference"] = round(
        ours["updates_per_s"] / ref["updates_per_s"], 3
    )
    result["overhead_goal_met"] = ours["overhead_over_compute"] <= 0.10
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
