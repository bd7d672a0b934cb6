"""Where a SecAgg+ round's milliseconds go, and its cost under the in-process engine.

Two parts, both on the vector round of ``bench/secagg_rounds.py`` (same ClientApp, same
timing loop, same warm-up):

* ``inprocess``: plain vs SecAgg+ round times under ``fedge.simulations.inprocess`` (no
  polling, no Ray: each pushed message runs the ClientApp at once), so the ratio is
  what the protocol itself costs, client and server, with no transport waits.
* ``profile``: the same SecAgg+ rounds under cProfile; milliseconds per round of the
  protocol's own steps (client crypto, quantisation, server unmask) and of the message
  and state handling around them.
* ``ray``: plain and SecAgg+ rounds on Flower's Ray engine with every ClientApp call
  timed inside its worker (``secagg_rounds.CLIENT_TIMES_ENV``): per stage, the server's
  wall time, the clients' summed in-app wall and CPU time, and the rest (Flower's
  pick-up every 0.1 s, Ray tasks, serialisation, our pulls).

Usage: ``python bench/secagg_profile.py [--clients 10,50] [--size 100000] [--rounds 5]``.
Prints one JSON object and writes it to ``bench/results/secagg_profile.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench import secagg_rounds
from bench._common import loadavg, write_result

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "secagg_profile.json"
PROFILED_VARIANT = "secagg_half_shares"
# (label, file suffix, function, caller function or "" for every caller): ms per round each
STEPS = (
    ("client: whole collect (incl. the app's reply)", "clients/secagg/engine.py", "_collect", ""),
    ("client: quantize", "fedge/secagg/vectors.py", "quantize", ""),
    ("client: masks (self + pairwise, AES-CTR)", "fedge/secagg/vectors.py", "prg_mask", "_collect"),
    ("client: Shamir split", "fedge/secagg/crypto.py", "split_secret", ""),
    ("client: HKDF", "fedge/secagg/crypto.py", "derive", ""),
    ("client: AES-GCM seal", "fedge/secagg/crypto.py", "seal", ""),
    ("client: key pinning and secrets", "clients/secagg/engine.py", "_check_neighbourhood", ""),
    ("client: whole unmask", "clients/secagg/engine.py", "_unmask", ""),
    ("client: AES-GCM unseal", "fedge/secagg/crypto.py", "unseal", ""),
    ("client: range clip", "clients/secagg/mod.py", "_clip_to_range", ""),
    ("client: the vector app (train)", "bench/secagg_rounds.py", "train", ""),
    ("client: privacy policy and mod dispatch", "clients/mods.py", "dispatch_mods", ""),
    ("server: collect requests", "server/secagg/engine.py", "collect_requests", ""),
    ("server: receive masked inputs", "server/secagg/engine.py", "receive_masked_inputs", ""),
    ("server: unmask requests", "server/secagg/engine.py", "unmask_requests", ""),
    ("server: unmask (sum, strip masks)", "server/secagg/engine.py", "_unmask", ""),
    ("server: Shamir combine", "fedge/secagg/crypto.py", "combine_secret", ""),
    ("server: masks (AES-CTR)", "fedge/secagg/vectors.py", "prg_mask", "_unmask"),
    ("engine: node state load", "simulations/inprocess.py", "load", ""),
    ("engine: node state save", "simulations/inprocess.py", "save", ""),
)


def inprocess_round_times(
    num_clients: int, size: int, rounds: int, variants: Sequence[str] = secagg_rounds.VARIANTS
) -> dict[str, Any]:
    """``time_rounds`` on an in-process grid of ``num_clients`` nodes (fresh node states)."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

    out: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        out.update(secagg_rounds.time_rounds(grid, num_clients, size, rounds, variants))

    with tempfile.TemporaryDirectory(prefix="fedge-secagg-inprocess-") as state:
        grid = InProcessGrid(secagg_rounds.client_app, DeviceTable(num_clients), Path(state))
        run_inprocess(server_app, grid)
    return out


def inprocess_ratios(clients: Sequence[int], size: int, rounds: int) -> dict[str, Any]:
    """Per client count: mean plain and SecAgg+ round seconds in process, and their ratios."""
    out: dict[str, Any] = {}
    for n in clients:
        times = inprocess_round_times(n, size, rounds)
        plain = float(np.mean(times["plain"]))
        row: dict[str, Any] = {"plain_s": round(plain, 4)}
        for name in secagg_rounds.VARIANTS[1:]:
            mean = float(np.mean(times[name]))
            row[f"{name}_s"] = round(mean, 4)
            row[f"{name}_ratio"] = round(mean / plain, 3)
            row[f"{name}_stage_s"] = times.get(f"{name}_stages", {})
        row["loadavg"] = loadavg()
        out[str(n)] = row
        print(f"inprocess n={n}: {row}", flush=True)
    return out


def profile(num_clients: int, size: int, rounds: int) -> dict[str, Any]:
    """Milliseconds per timed round of each protocol step (cProfile, in process, n/2 shares).

    The warm-up round (key advertisement) is profiled too but its share is removed by
    profiling a warm-up-only run and subtracting it; an unprofiled run first pays the imports.
    """
    inprocess_round_times(num_clients, size, 0, [PROFILED_VARIANT])
    full = _profiled(num_clients, size, rounds)
    warm = _profiled(num_clients, size, 0)
    steps = {}
    for label, suffix, func, caller in STEPS:
        ms = _cumulative(full, suffix, func, caller) - _cumulative(warm, suffix, func, caller)
        steps[label] = round(1000 * ms / rounds, 2)
    total = (_total(full) - _total(warm)) / rounds
    return {
        "clients": num_clients,
        "variant": PROFILED_VARIANT,
        "round_ms_under_profiler": round(1000 * total, 1),
        "steps_ms_per_round": steps,
        "top_own_time_ms_per_round": _top_own(full, warm, rounds),
        "loadavg": loadavg(),
    }


def _profiled(num_clients: int, size: int, rounds: int) -> pstats.Stats:
    prof = cProfile.Profile()
    prof.enable()
    inprocess_round_times(num_clients, size, rounds, [PROFILED_VARIANT])
    prof.disable()
    return pstats.Stats(prof)


def _entries(stats: pstats.Stats) -> dict[tuple[str, int, str], tuple[Any, ...]]:
    return stats.stats  # type: ignore[attr-defined, no-any-return]


def _cumulative(stats: pstats.Stats, suffix: str, func: str, caller: str) -> float:
    """Cumulative seconds of ``func`` in files ending in ``suffix`` (only under ``caller``)."""
    total = 0.0
    for (path, _, name), (_, _, _, cum, callers) in _entries(stats).items():
        if name != func or not path.endswith(suffix):
            continue
        if not caller:
            total += cum
            continue
        total += sum(v[3] for (_, _, cname), v in callers.items() if cname == caller)
    return total


def _total(stats: pstats.Stats) -> float:
    return float(stats.total_tt)  # type: ignore[attr-defined]


def _top_own(
    full: pstats.Stats, warm: pstats.Stats, rounds: int, top: int = 15
) -> dict[str, float]:
    """The functions with the most own time per timed round (warm-up subtracted)."""
    base = {k: v[2] for k, v in _entries(warm).items()}
    own = {k: v[2] - base.get(k, 0.0) for k, v in _entries(full).items()}
    best = sorted(own.items(), key=lambda kv: -kv[1])[:top]
    return {
        f"{Path(path).parent.name}/{Path(path).name}:{name}": round(1000 * sec / rounds, 2)
        for (path, _, name), sec in best
    }


def ray_breakdown(num_clients: int, size: int, rounds: int) -> dict[str, Any]:
    """Per stage on Ray: server wall seconds, clients' in-app seconds (wall, CPU), all per round."""
    from bench.privacy import ours_round_times

    variants = ("plain", PROFILED_VARIANT)
    with tempfile.TemporaryDirectory(prefix="fedge-secagg-clienttimes-") as folder:
        os.environ[secagg_rounds.CLIENT_TIMES_ENV] = folder
        try:
            times = ours_round_times(num_clients, size, rounds, variants)
        finally:
            del os.environ[secagg_rounds.CLIENT_TIMES_ENV]
        lines = [
            ln.split("\t") for f in Path(folder).glob("*.tsv") for ln in f.read_text().splitlines()
        ]
    client: dict[str, list[float]] = {}
    for stage, wall, cpu in lines:
        acc = client.setdefault(stage, [0.0, 0.0, 0.0])
        acc[0] += float(wall) / rounds
        acc[1] += float(cpu) / rounds
        acc[2] += 1 / rounds
    stages = {"plain": float(np.mean(times["plain"]))}
    stages.update(times.get(f"{PROFILED_VARIANT}_stages", {}))
    out: dict[str, Any] = {
        "plain_round_s": round(float(np.mean(times["plain"])), 4),
        "secagg_round_s": round(float(np.mean(times[PROFILED_VARIANT])), 4),
    }
    for stage, wall_s in stages.items():
        key = "plain" if stage == "plain" else stage
        c_wall, c_cpu, msgs = client.get(key, [0.0, 0.0, 0.0])
        out[stage] = {
            "server_wall_s": round(wall_s, 4),
            "messages": round(msgs, 1),
            "clients_in_app_wall_s": round(c_wall, 4),
            "clients_in_app_cpu_s": round(c_cpu, 4),
        }
    out["loadavg"] = loadavg()
    print(f"ray n={num_clients}: {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the parts asked for; print and write the JSON result (parts skipped keep theirs)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="10,50")
    p.add_argument("--size", type=int, default=100_000, help="floats per client vector")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parts", default="inprocess,profile")
    args = p.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    parts = set(args.parts.split(","))
    clients = [int(c) for c in args.clients.split(",")]
    result: dict[str, Any] = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.is_file() else {}
    result.update({"bench": "secagg_profile", "vector_size": args.size, "rounds": args.rounds})
    if "inprocess" in parts:
        result["inprocess"] = inprocess_ratios(clients, args.size, args.rounds)
    if "ray" in parts:
        result["ray"] = {str(n): ray_breakdown(n, args.size, args.rounds) for n in clients}
    if "profile" in parts:
        result["profile"] = {str(n): profile(n, args.size, args.rounds) for n in clients}
        print(f"profile: {result['profile']}", flush=True)
    return write_result(RESULTS_FILE, result)


if __name__ == "__main__":
    main()
