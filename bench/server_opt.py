"""FedAvg against the server optimizers (FedAdam, FedYogi, FedAvgM) on the demo federation.

Each arm runs the `demo` scenario (the demo zoo, six stdlib packages as clients, every
client every round) with the same seed, client lr and local steps; only the server step
differs (``server-optimizer`` and ``server-lr``). Baseline in the same run: plain FedAvg.
The target is FedAvg's participants' held-out perplexity after its last round; each arm
reports the first round that reaches it, its perplexity per round, and the speed-up
(FedAvg's rounds to the target over the arm's; above 1 means fewer rounds). A PNG plots
perplexity per round, one curve per arm.

Reddi et al. (ICLR 2021) tune the server step per task; ``--arms`` takes
``name:optimizer:server-lr`` triples, so a sweep is one command. Prints one JSON object as
the last line and writes it to bench/results/server_opt.json.

Usage: python bench/server_opt.py [--rounds 8] [--arms fedadam:fedadam:0.03,...] [--set key=value]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import config_value, loadavg, write_result

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "server_opt.json"
BASELINE = "fedavg:none:1.0"
ARMS = "fedadam-0.01:fedadam:0.01,fedadam-0.03:fedadam:0.03,fedyogi-0.03:fedyogi:0.03,fedavgm-1:fedavgm:1.0"


def parse_arms(text: str) -> list[tuple[str, str, float]]:
    """``name:optimizer:server-lr`` triples, comma-separated; the baseline FedAvg comes first."""
    arms = []
    for item in [BASELINE, *filter(None, text.split(","))]:
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"--arms item {item!r} is not name:optimizer:server-lr")
        arms.append((parts[0], parts[1], float(parts[2])))
    return arms


def run_arm(optimizer: str, server_lr: float, overrides: Mapping[str, Any]) -> list[float]:
    """Participants' held-out perplexity after each round (round 0 first) of one federation."""
    from fedge.server.rundir import MetricsLog
    from fedge.simulations.runner import load_scenario, run_simulation

    config = {**overrides, "server-optimizer": optimizer, "server-lr": server_lr}
    scenario = load_scenario("demo", config)
    with tempfile.TemporaryDirectory(prefix="fedge-serveropt-") as tmp:
        run = Path(tmp) / "run"
        run_simulation(scenario, run)
        rows = MetricsLog(run).rows()
    return [float(r["participants_perplexity"]) for r in rows]


def first_round_at(curve: Sequence[float], target: float) -> int | None:
    """The first round whose perplexity is at or below ``target`` (None: never reached)."""
    return next((i for i, ppl in enumerate(curve) if i > 0 and ppl <= target), None)


def figures(curves: Mapping[str, list[float]], baseline: str) -> dict[str, Any]:
    """Rounds to FedAvg's final perplexity per arm, and the speed-up over FedAvg."""
    target = curves[baseline][-1]
    base_rounds = first_round_at(curves[baseline], target)
    arms: dict[str, Any] = {}
    for name, curve in curves.items():
        rounds = first_round_at(curve, target)
        arms[name] = {
            "perplexity_by_round": [round(p, 3) for p in curve],
            "final_perplexity": round(curve[-1], 3),
            "rounds_to_target": rounds,
            "speedup_vs_fedavg": (
                round(base_rounds / rounds, 3) if rounds and base_rounds else None
            ),
        }
    return {"target_perplexity": round(target, 3), "arms": arms}


def plot(curves: Mapping[str, list[float]], target: float, out: Path) -> Path:
    """Perplexity per round, one curve per arm, the target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        ax.plot(range(len(curve)), curve, marker="o", label=name)
    ax.axhline(target, color="grey", linestyle=":", label="target: FedAvg's last round")
    ax.set_xlabel("round")
    ax.set_ylabel("participants' held-out perplexity")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every arm, print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--arms", default=ARMS, help="name:optimizer:server-lr, comma-separated")
    parser.add_argument("--set", action="append", default=[], help="key=value config override")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {"num-server-rounds": args.rounds}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = config_value(value)
    os.environ.setdefault("FEDGE_QUIET", "1")
    load_before, started = loadavg(), time.perf_counter()
    curves: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for name, optimizer, server_lr in parse_arms(args.arms):
        t0 = time.perf_counter()
        curves[name] = run_arm(optimizer, server_lr, overrides)
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {[round(p, 2) for p in curves[name]]} ({seconds[name]} s)", flush=True)
    baseline = parse_arms("")[0][0]
    result = {
        "bench": "server_opt",
        "scenario": "demo",
        "config": {"rounds": args.rounds, "arms": args.arms, "overrides": overrides},
        **figures(curves, baseline),
        "arm_seconds": seconds,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(curves, result["target_perplexity"], out.with_suffix(".png")))
    return write_result(out, result)


if __name__ == "__main__":
    main()
