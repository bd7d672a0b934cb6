"""SecAgg+ cost of several source trees side by side: the same vector rounds, trees run alternately.

A change's cost on a shared machine is only visible against the code before it measured
in the same minutes. Each repetition runs every tree once, in an order rotated per
repetition so that load drifting during the bench hits all trees alike; each run is a
fresh process with only that tree on ``PYTHONPATH``, timing plain and SecAgg+ (default
neighbour graph) rounds with that tree's own loop (``bench/secagg_rounds.py``), on
Flower's Ray engine (``bench.privacy.ours_round_times``) or in process
(``bench.secagg_profile.inprocess_round_times``). Any tree with those two functions can
be compared, e.g. a worktree of the commit before a change::

    git worktree add --detach /tmp/before <commit>
    python -m bench.secagg_ab --trees /tmp/before,. --engine ray --clients 10 --reps 4

Per run: every timed round, medians, the ratio of the medians and the load average; per
tree: the same over all its rounds, and the share of SecAgg+ rounds under 0.25 s (on Ray,
the rounds that took two of Flower's 0.1 s pick-up intervals, not three). The JSON goes
to ``bench/results/secagg_ab.json``, one entry per engine and client count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import loadavg, write_result

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "secagg_ab.json"
VARIANTS = ("plain", "secagg_default_graph")
TWO_INTERVALS_S = 0.25  # a SecAgg+ round under this took two 0.1 s pick-ups on Ray, not three
# Run with `python -c` and only the measured tree on the path: no module of this tree loads.
CHILD = """
import json, sys
engine, n, size, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
variants = ("plain", "secagg_default_graph")
if engine == "ray":
    from bench.privacy import ours_round_times as timed
else:
    from bench.secagg_profile import inprocess_round_times as timed
out = timed(n, size, rounds, variants)
print("AB-RESULT " + json.dumps({v: out[v] for v in variants}), flush=True)
"""


def run_tree(tree: Path, engine: str, clients: int, size: int, rounds: int) -> dict[str, Any]:
    """One run of ``tree`` in a fresh process: its timed rounds per variant and the load."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, engine, str(clients), str(size), str(rounds)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("AB-RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{tree}: run failed ({done.returncode}): {done.stderr[-2000:]}")
    times: dict[str, list[float]] = json.loads(lines[-1].split(" ", 1)[1])
    plain, secagg = (statistics.median(times[v]) for v in VARIANTS)
    return {
        "plain_s": [round(t, 4) for t in times["plain"]],
        "secagg_s": [round(t, 4) for t in times["secagg_default_graph"]],
        "ratio_of_medians": round(secagg / plain, 3),
        "loadavg": loadavg(),
    }


def tree_label(tree: Path) -> str:
    """The tree's commit (short hash), with '+dirty' when it has uncommitted changes."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """All of a tree's rounds together: medians, their ratio, the share of two-interval rounds."""
    plain = [t for r in runs for t in r["plain_s"]]
    secagg = [t for r in runs for t in r["secagg_s"]]
    return {
        "plain_median_s": round(statistics.median(plain), 4),
        "secagg_median_s": round(statistics.median(secagg), 4),
        "ratio_of_medians": round(statistics.median(secagg) / statistics.median(plain), 3),
        "ratio_per_run": [r["ratio_of_medians"] for r in runs],
        "secagg_rounds_under_0.25s": round(
            sum(t < TWO_INTERVALS_S for t in secagg) / len(secagg), 3
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every tree ``--reps`` times, alternately; print and write the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True, help="comma-separated source trees (repo roots)")
    p.add_argument("--engine", choices=("ray", "inprocess"), default="ray")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--size", type=int, default=100_000, help="floats per client vector")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per run and variant")
    p.add_argument("--reps", type=int, default=4, help="runs per tree")
    args = p.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",") if t]
    labels = [f"{tree_label(t)} ({t.name})" for t in trees]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for rep in range(args.reps):
        for i in range(len(trees)):  # rotate the order every repetition
            k = (rep + i) % len(trees)
            run = run_tree(trees[k], args.engine, args.clients, args.size, args.rounds)
            runs[labels[k]].append(run)
            print(f"{labels[k]}: {run}", flush=True)
    result: dict[str, Any] = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.is_file() else {}
    result["bench"] = "secagg_ab"
    result[f"{args.engine}_{args.clients}"] = {
        "vector_size": args.size,
        "rounds_per_run": args.rounds,
        "trees": {label: {**summary(r), "runs": r} for label, r in runs.items()},
    }
    return write_result(RESULTS_FILE, result)


if __name__ == "__main__":
    main()
