"""Model poisoning against the default defence and each robust rule: participants' perplexity.

Each cell is one federation of the micro zoo on the in-process engine (``quick`` scenario:
natural partition, every client every round), clean or with attackers, the first partitions
sending their update x(-50) at weight x1e6 (``x-fault-partitions = "0:poison"``, the attack
of issue 30, :mod:`fedge.clients.faults`). Rows: 3, 5, 7 clients with 1, 1, 2 attackers.
Columns (arms):

* ``plain``: the mean with no defence (``norm-bound-multiple = weight-cap-multiple = 0``),
  what every run got before the default defence;
* ``default``: no option set (the adaptive norm bound at 3x the round's median update
  norm and the weight cap at 3x the median weight, :func:`fedge.strategies.robust.adaptive_bounds`);
* ``median``, ``trimmed-mean`` (beta 0.2, Flower's default), ``krum`` (f = the attackers):
  each rule ALONE (the default defence switched off), to show what the rule does by itself.

Figures per cell: the participants' held-out perplexity after the last round, and the
poisoned / clean ratio (goal: default within 1.10 of its clean run; the default's clean run
within 1% of the plain clean run). Prints one JSON object as the last line and writes it to
bench/results/poisoning.json.

Usage: python bench/poisoning.py [--rounds 2] [--sizes 3:1,5:1,7:2] [--arms plain,default,...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import config_value, loadavg, write_result

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "poisoning.json"
OFF = {"norm-bound-multiple": 0.0, "weight-cap-multiple": 0.0}
ARMS: dict[str, dict[str, Any]] = {
    "plain": dict(OFF),
    "default": {},
    "median": {**OFF, "aggregator": "median"},
    "trimmed-mean": {**OFF, "aggregator": "trimmed-mean"},
    "krum": {**OFF, "aggregator": "krum"},
}


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``clients:attackers`` pairs, comma-separated."""
    out = []
    for item in filter(None, text.split(",")):
        n, _, f = item.partition(":")
        out.append((int(n), int(f)))
    return out


def run_cell(
    clients: int, attackers: int, arm: Mapping[str, Any], overrides: Mapping[str, Any]
) -> float:
    """Participants' held-out perplexity after the last round of one federation."""
    from fedge.server.rundir import MetricsLog
    from fedge.simulations.runner import load_scenario, run_simulation

    config: dict[str, Any] = {
        "min-available-nodes": clients,
        "min-train-nodes": 2,
        "client-eval": False,
        "plots": False,
        "tensorboard": False,
        "save-merged": False,
        **overrides,
        **arm,
    }
    if arm.get("aggregator") == "krum":
        config["krum-malicious"] = attackers
    if attackers:
        config["client-mods"] = "faults"
        config["x-fault-partitions"] = ",".join(f"{p}:poison" for p in range(attackers))
    scenario = load_scenario("quick", config, {"num-supernodes": clients, "engine": "inprocess"})
    with tempfile.TemporaryDirectory(prefix="fedge-poisoning-") as tmp:
        run = Path(tmp) / "run"
        run_simulation(scenario, run)
        rows = MetricsLog(run).rows()
    return float(rows[-1]["participants_perplexity"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every (size, arm) clean and poisoned; print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="3:1,5:1,7:2", help="clients:attackers, comma-separated")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {', '.join(ARMS)}")
    parser.add_argument("--set", action="append", default=[], help="key=value config override")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {"num-server-rounds": args.rounds}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = config_value(value)
    t0 = time.perf_counter()
    load_before = loadavg()
    table: dict[str, Any] = {}
    for clients, attackers in parse_sizes(args.sizes):
        row: dict[str, Any] = {}
        for name in filter(None, args.arms.split(",")):
            clean = run_cell(clients, 0, ARMS[name], overrides)
            poisoned = run_cell(clients, attackers, ARMS[name], overrides)
            row[name] = {
                "clean": round(clean, 3),
                "poisoned": round(poisoned, 3),
                "poisoned_over_clean": round(poisoned / clean, 4),
            }
            print(f"{clients} clients, {attackers} attacker(s), {name}: {row[name]}", flush=True)
        if "plain" in row and "default" in row:
            row["default_clean_over_plain_clean"] = round(
                row["default"]["clean"] / row["plain"]["clean"], 5
            )
        table[f"{clients}:{attackers}"] = row
    return write_result(
        args.out,
        {
            "bench": "poisoning",
            "model": "zoo:micro",
            "scenario": "quick (natural partition, in-process engine)",
            "rounds": args.rounds,
            "attack": "update x(-50), weight x1e6 (x-fault-partitions poison)",
            "metric": "participants' held-out perplexity after the last round",
            "overrides": {k: v for k, v in overrides.items()},
            "table": table,
            "seconds": round(time.perf_counter() - t0, 1),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
    )


if __name__ == "__main__":
    main()
