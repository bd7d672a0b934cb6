"""Private learning at population scale: where DP stops costing perplexity, by cohort size.

For each cohort size K (Poisson cohorts from the phones eligible under the virtual clock,
``privacy-sampling = "poisson"``) it runs the population scenario three ways with the same
cohort law: plain (no DP, no SecAgg+), SecAgg+ with distributed DP, and central DP, the
last two at every noise multiplier asked for. Per run it reports the participants'
held-out perplexity (last round, and against the plain run with the same K), epsilon at
delta = 1/population by PLD and RDP, amplified (against whoever sees the released adapters)
and unamplified (against the server, which knows the cohort), simulated hours, wasted
device hours, and the SecAgg+ dropouts whose masks were recovered. A PNG plots perplexity
against epsilon, one curve per cohort size. Goal: some K with epsilon <= 8 (PLD) within
2% of its plain run's perplexity.

The full configuration (``--population 1000,10000 --cohorts 10,50,100,200``, 20 rounds,
the demo zoo, plain + distributed + central DP at one noise multiplier) trains about
43,000 client steps; at the ~0.15 s per client step measured here (load 10) that is about
2 hours per noise multiplier, plus SecAgg+'s key agreement at cohorts of 200. ``--small``
runs 6 rounds with 4 server evaluation batches: minutes at cohorts of 10 and 50.

``--memory`` measures peak RSS as well: each mechanism (default plain and ddp) runs in a
child process of its own, whose peak resident set ``os.wait4`` reports (so the arms share no
peak), at the first population and cohort given, for ``--rounds`` (default 3) rounds; each
arm keeps the run's figures above, so one pair of runs gives perplexity, epsilon and RSS. Goal:
SecAgg+ at 10,000 devices <= 1.2x the plain run's peak. Written to
``bench/results/private_population_memory.json``.

``--until-plateau`` runs each federation until the participants' held-out perplexity stops
improving (``PLATEAU``: two rounds in a row without dropping 0.5% below the earlier best,
``server/plateau.py``), at most ``--rounds``; pick the noise multiplier so that epsilon at that
cap stays within the goal, and ``--set max-epsilon=8`` (DP arms only) stops a run before a
round that would pass it. Epsilon is computed from the releases the run made.

Usage: python -m bench.private_population [--small] [--population 1000] [--cohorts 10,50]
       [--noise 1.0] [--rounds 20] [--mechanisms plain,ddp,central] [--set key=value ...]
       [--until-plateau]
       python -m bench.private_population --memory --population 10000 --cohorts 100
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import config_value

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "private_population.json"
SCENARIOS = {1000: "private_population", 10_000: "private_population_10k"}
MECHANISMS = {
    "plain": {"aggregator": "plain"},
    "ddp": {"aggregator": "fedge.server.privacy.factories:secagg_distributed_dp"},
    "central": {"aggregator": "fedge.server.privacy.factories:central_dp"},
}
MEMORY_RESULTS = REPO / "bench" / "results" / "private_population_memory.json"
SMALL = {"num-server-rounds": 6, "server-eval-batches": 4}  # minutes on 2 shared cores
MEMORY_GOAL = 1.2  # SecAgg+ peak RSS over the plain run's, same population and cohort
SECAGG_DROPOUT = "dropped out of the SecAgg+ round"
GOAL_EPSILON, GOAL_GAP = 8.0, 0.02
# --until-plateau: stop once two rounds in a row leave the participants' held-out perplexity
# above 99.5% of its earlier best (server/plateau.py), at most --rounds (the scenario's 20)
PLATEAU = {"plateau-patience": 2, "plateau-min-improvement": 0.005}


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def run_one(
    population: int, cohort: int, mechanism: str, noise: float, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """One federation; its figures (see the module docstring)."""
    from fedge.server.checkpoint import load_checkpoint
    from fedge.server.rundir import MetricsLog
    from fedge.simulations.runner import load_scenario, run_simulation

    config = {
        **overrides,
        **MECHANISMS[mechanism],
        "target-reports": cohort,
        "dp-noise-multiplier": noise,
        "dp-target-delta": 1.0 / population,
    }
    if mechanism == "plain":  # no DP, nothing to budget (a max-epsilon there is refused)
        config.pop("max-epsilon", None)
    scenario = load_scenario(SCENARIOS.get(population, "private_population"), config)
    if population not in SCENARIOS:
        from dataclasses import replace

        scenario = replace(scenario, num_supernodes=population)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedge-private-") as tmp:
        run = Path(tmp) / "run"
        outcome = run_simulation(scenario, run)
        rows = MetricsLog(run).rows()
        summary = json.loads((run / "devices" / "summary.json").read_text())
        draws = _draws(load_checkpoint(run).budget_state)
    last = rows[-1]
    recovered = sum(
        sum(SECAGG_DROPOUT in why for why in r.get("rejected", {}).values())
        for r in rows
        if r["status"] == "ok"
    )
    figures: dict[str, Any] = {
        "population": population,
        "cohort": cohort,
        "mechanism": mechanism,
        "noise_multiplier": noise if mechanism != "plain" else None,
        "status": outcome.status if outcome else "no outcome",
        "message": outcome.message if outcome else "",
        "rounds": int(last["round"]),
        "participants_perplexity": last.get("participants_perplexity"),
        "participants_perplexity_round0": rows[0].get("participants_perplexity"),
        "participants_perplexity_by_round": [r.get("participants_perplexity") for r in rows],
        "cohort_sizes": [r["clients_sampled"] for r in rows[1:]],
        "simulated_hours": summary["simulated_hours"],
        "wasted_device_hours": summary["wasted_device_hours"],
        "secagg_dropouts_recovered": recovered if mechanism == "ddp" else None,
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    if mechanism != "plain":
        figures.update(_epsilons(draws, noise, 1.0 / population))
    return figures


def _draws(budget_state: Mapping[str, float]) -> list[tuple[int, int]]:
    """The (n, K) of every release, from the amplified budget's checkpoint state."""
    count = int(budget_state.get("releases", 0))
    return [(int(budget_state[f"n{i}"]), int(budget_state[f"k{i}"])) for i in range(count)]


def _epsilons(draws: Sequence[tuple[int, int]], z: float, delta: float) -> dict[str, float]:
    """Amplified (observers of the model) and unamplified (the server) epsilon, PLD and RDP."""
    from fedge.privacy.accounting import gaussian_epsilon
    from fedge.server.sampling import sampled_epsilon

    return {
        "epsilon_pld": sampled_epsilon("poisson", draws, z, delta, "pld"),
        "epsilon_rdp": sampled_epsilon("poisson", draws, z, delta, "rdp"),
        "epsilon_server_view_pld": gaussian_epsilon([z] * len(draws), delta, "pld"),
        "epsilon_server_view_rdp": gaussian_epsilon([z] * len(draws), delta, "rdp"),
    }


def verdict(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per DP run, the gap to its plain run with the same population and cohort; the goal."""
    plain = {
        (r["population"], r["cohort"]): r["participants_perplexity"]
        for r in runs
        if r["mechanism"] == "plain"
    }
    learnt = {  # a plain run that gained less than 2% makes "within 2% of plain" vacuous
        (r["population"], r["cohort"])
        for r in runs
        if r["mechanism"] == "plain"
        and r["participants_perplexity"] is not None
        and r["participants_perplexity"] < (1 - GOAL_GAP) * r["participants_perplexity_round0"]
    }
    hits = []
    for r in runs:
        key = (r["population"], r["cohort"])
        base = plain.get(key)
        if r["mechanism"] == "plain" or base is None or r["participants_perplexity"] is None:
            continue
        r_gap = r["participants_perplexity"] / base - 1.0  # type: ignore[index]
        r["gap_to_plain"] = r_gap  # type: ignore[index]
        start = r["participants_perplexity_round0"]
        if start and base < start:  # the share of the plain run's gain the DP run kept
            r["gain_kept"] = (start - r["participants_perplexity"]) / (start - base)  # type: ignore[index]
        if key in learnt and r["epsilon_pld"] <= GOAL_EPSILON and r_gap <= GOAL_GAP:
            hits.append(
                {k: r[k] for k in ("population", "cohort", "mechanism", "epsilon_pld")}
                | {"gap_to_plain": r_gap}
            )
    return {
        "goal": f"epsilon_pld <= {GOAL_EPSILON} within {GOAL_GAP:.0%} of a plain run that gained > {GOAL_GAP:.0%}",
        "plain_runs_that_learnt": sorted(learnt),
        "hits": hits,
        "hit": bool(hits),
    }


def plot(runs: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """Participants' perplexity against epsilon (PLD), one curve per cohort size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cohorts = sorted({(r["population"], r["cohort"]) for r in runs})
    for pop, k in cohorts:
        for mech, marker in (("ddp", "o-"), ("central", "s--")):
            pts = sorted(
                (r["epsilon_pld"], r["participants_perplexity"])
                for r in runs
                if (r["population"], r["cohort"], r["mechanism"]) == (pop, k, mech)
                and r["participants_perplexity"] is not None
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker, label=f"N={pop} K={k} {mech}")
        base = [
            r["participants_perplexity"]
            for r in runs
            if (r["population"], r["cohort"], r["mechanism"]) == (pop, k, "plain")
        ]
        if base and base[0] is not None:
            ax.axhline(base[0], linestyle=":", linewidth=1, label=f"N={pop} K={k} plain")
    ax.axvline(GOAL_EPSILON, color="grey", linewidth=0.8)
    ax.set_xlabel("epsilon (PLD, delta = 1/population, amplified by Poisson sampling)")
    ax.set_ylabel("participants' held-out perplexity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def arm_peak_rss(argv: Sequence[str]) -> tuple[dict[str, Any], float]:
    """Run this bench with ``argv`` in a child process: its result and its own peak RSS in MiB."""
    with tempfile.TemporaryDirectory(prefix="fedge-rss-") as tmp:
        out = Path(tmp) / "arm.json"
        cmd = [sys.executable, "-m", "bench.private_population", *argv, "--out", str(out)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        return json.loads(out.read_text()), usage.ru_maxrss / 1024  # Linux: KiB


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS of each mechanism's run, each in its own process; the ratio to plain."""
    population = args.population.split(",")[0]
    cohort = args.cohorts.split(",")[0]
    rounds = str(args.rounds or 3)
    common = ["--population", population, "--cohorts", cohort, "--rounds", rounds]
    common += ["--noise", args.noise.split(",")[0], *(["--small"] if args.small else [])]
    common += ["--until-plateau"] if args.until_plateau else []
    common += [f"--set={item}" for item in args.set]
    load_before = _loadavg()
    arms: dict[str, dict[str, Any]] = {}
    for mechanism in args.mechanisms.split(","):
        result, peak = arm_peak_rss([*common, "--mechanisms", mechanism])
        arms[mechanism] = {"peak_rss_mib": round(peak, 1), **result["runs"][0]}
        print(json.dumps({mechanism: arms[mechanism]}), flush=True)
    ratios = {
        m: round(a["peak_rss_mib"] / arms["plain"]["peak_rss_mib"], 3)
        for m, a in arms.items()
        if "plain" in arms and m != "plain"
    }
    result = {
        "bench": "private_population_memory",
        "population": int(population),
        "cohort": int(cohort),
        "rounds": int(rounds),
        "overrides": args.set,
        "arms": arms,
        "peak_rss_vs_plain": ratios,
        "goal": f"secagg+ (ddp) peak RSS <= {MEMORY_GOAL}x plain",
        "hit": ratios.get("ddp", float("inf")) <= MEMORY_GOAL,
        "verdict": verdict(list(arms.values())),  # the arms' perplexity figures, as a sweep's
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "machine": f"{os.cpu_count()} cores, shared",
    }
    out = Path(args.out) if args.out != str(RESULTS) else MEMORY_RESULTS
    result["plot"] = str(plot(list(arms.values()), out.with_suffix(".png")))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweep (or, with ``--memory``, the peak-RSS comparison), print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="minutes on 2 cores: " + str(SMALL))
    parser.add_argument("--population", default="1000", help="comma-separated: 1000,10000")
    parser.add_argument("--cohorts", default="10,50,100,200")
    parser.add_argument("--noise", default="1.0", help="noise multipliers z, comma-separated")
    parser.add_argument("--rounds", type=int, default=0, help="0: the scenario's (20)")
    parser.add_argument("--mechanisms", default="plain,ddp,central")
    parser.add_argument("--set", action="append", default=[], help="key=value config override")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--until-plateau",
        action="store_true",
        help=f"stop each run when its participants' perplexity plateaus: {PLATEAU}, "
        "evaluated every round, --rounds the cap (the epsilon reported is the rounds run's)",
    )
    parser.add_argument(
        "--memory", action="store_true", help="peak RSS per mechanism, each in its own process"
    )
    args = parser.parse_args(argv)
    if args.memory:
        if args.mechanisms == parser.get_default("mechanisms"):
            args.mechanisms = "plain,ddp"
        return memory(args)
    overrides: dict[str, Any] = dict(SMALL) if args.small else {}
    if args.rounds:
        overrides["num-server-rounds"] = args.rounds
    if args.until_plateau:
        overrides.update(PLATEAU)
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = config_value(value)
    os.environ.setdefault("FEDGE_QUIET", "1")
    load_before = _loadavg()
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for population in (int(p) for p in args.population.split(",")):
        for cohort in (int(k) for k in args.cohorts.split(",")):
            for mechanism in args.mechanisms.split(","):
                noises = (
                    [1.0] if mechanism == "plain" else [float(z) for z in args.noise.split(",")]
                )
                for z in noises:
                    runs.append(run_one(population, cohort, mechanism, z, overrides))
                    print(json.dumps(runs[-1]), flush=True)
    result = {
        "bench": "private_population",
        "config": {**vars(args), "overrides": overrides},
        "runs": runs,
        "verdict": verdict(runs),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "machine": f"{os.cpu_count()} cores, shared",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(runs, out.with_suffix(".png")))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["verdict"]))
    return result


if __name__ == "__main__":
    main()
