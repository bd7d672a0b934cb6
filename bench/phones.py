"""The phones scenario: FedAvg vs FedProx vs SCAFFOLD on simulated devices, in simulated hours.

Runs `fedge simulate phones` (the demo zoo; all three strategies, one after the other, on
the scenario's engine) and reads each run's device reports. Each strategy trains at its own
learning rate, tuned for its own optimizer (AdamW for FedAvg and FedProx, SGD for SCAFFOLD):
the scenario's ``[strategy.<name>]`` tables are the one source, and each run's resolved
config is read back to report it. The target perplexity is the scenario's, or, when it sets
none, ``--target-drop`` (default 3%) below the round-0 perplexity (the same starting model
for every strategy); ``baseline_reached_target`` says whether FedAvg got there (if not,
every "hours to target" is None: raise ``--rounds``, not the target). Baseline in the same
run: FedAvg; the ratios are each strategy's simulated hours to the target over FedAvg's.

Per strategy: simulated hours to the target and in total, final and best perplexity,
clients trained / partial / selected, dropouts by cause (offline, deadline, late,
memory), wasted compute (device-hours and fraction), devices that ever trained, upload
per participant, and participation by tier. Prints one JSON object as the last line and
writes it to bench/results/phones.json.

Usage: python bench/phones.py [--rounds 12] [--target-drop 0.03] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "phones.json"
STRATEGIES = ("fedavg", "fedprox", "scaffold")


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _strategy_figures(run: Path, target: float) -> dict[str, Any]:
    """One strategy's figures from its run directory."""
    from fedge.server.rundir import read_config
    from fedge.simulations.devicesim.report import hours_to_target, read_rounds
    from fedge.strategies.registry import build_strategy

    config = read_config(run)
    summary = json.loads((run / "devices" / "summary.json").read_text())
    rounds = read_rounds(run)
    ppl = [r["perplexity"] for r in rounds if isinstance(r.get("perplexity"), int | float)]
    return {
        "lr": config["lr"],
        "optimizer": config["optimizer"]
        if config.get("optimizer", "auto") != "auto"
        else build_strategy(config).local_optimizer,
        "hours_to_target": hours_to_target(rounds, target),
        "simulated_hours": summary["simulated_hours"],
        "final_perplexity": ppl[-1] if ppl else None,
        "best_perplexity": min(ppl) if ppl else None,
        "selected": summary["selected"],
        "trained": summary["trained"],
        "partial": summary["partial"],
        "dropped": summary["dropped"],
        "wasted_device_hours": summary["wasted_device_hours"],
        "wasted_fraction": summary["wasted_fraction"],
        "devices_trained": summary["devices_trained"],
        "devices": summary["devices"],
        "bytes_up_per_participant": summary["bytes_up_per_participant"],
        "trained_by_tier": {k: v["trained"] for k, v in summary["by_tier"].items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--target-drop", type=float, default=0.03)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="bench-phones-"))
    cmd = [sys.executable, "-m", "fedge.cli", "simulate", "phones", "--out", str(out)]
    cmd += ["--strategy", ",".join(STRATEGIES)]
    if args.rounds:
        cmd += ["--rounds", str(args.rounds)]
    for item in args.sets:
        cmd += ["--set", item]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    load_before = _loadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"fedge simulate phones failed with exit code {proc.returncode}")

    from fedge.simulations.runner import load_scenario

    scenario = load_scenario("phones")
    assert scenario.devices is not None
    first = json.loads((out / STRATEGIES[0] / "metrics.jsonl").read_text().splitlines()[0])
    target = scenario.devices.target_perplexity
    if target <= 0:
        target = round(first["perplexity"] * (1 - args.target_drop), 3)
    figures = {s: _strategy_figures(out / s, target) for s in STRATEGIES}
    base = figures["fedavg"]["hours_to_target"]
    ratios = {
        s: (f["hours_to_target"] / base if base and f["hours_to_target"] is not None else None)
        for s, f in figures.items()
    }
    result = {
        "bench": "phones",
        "scenario": scenario.description,
        "rounds": args.rounds or scenario.config.num_server_rounds,
        "target_perplexity": target,
        "initial_perplexity": round(first["perplexity"], 3),
        "strategies": figures,
        "hours_to_target_vs_fedavg": ratios,
        "baseline_reached_target": base is not None,
        "wall_seconds": round(wall, 1),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "run_dir": str(out),
    }
    if base is None:
        sys.stderr.write(
            f"FedAvg never reached perplexity {target} in {result['rounds']} rounds: "
            "hours to target are not comparable; raise --rounds\n"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
