"""Ring attention prefill against one process: memory per rank, longest prompt per budget, time.

For a prompt of `--length` tokens (and half of it, to fit a line) on the zoo target:
- one process: the model's own forward (SDPA attention, a DynamicCache), in a spawned process;
- rings of N = `--sizes` worker processes (`fedge.edge.verifier.ring`, gloo on CPU).

Memory is measured per process as the growth of its resident set during the prefill: the
peak RSS (Linux VmHWM, reset through /proc/self/clear_refs just before) minus the RSS before.
It covers the KV kept, the attention workspace, the blocks in flight and the layer's
activations; the weights were loaded before and are not in it. glibc is told to map every
allocation over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the RSS and
a later peak is not hidden in reused heap. The longest prompt a worker serves under a fixed
per-worker budget (the one process's peak at `--length`) comes from the line through each
N's two measured points.

Time: wall time per prefill (the engine's call, pipes included) against the one process; the
ranks' exposed communication (time blocked on a ring transfer after the block in hand was
done: transfer time not hidden, plus waiting on a slower neighbour) as a share of the wall
time; the transfers alone (`RingPool.probe`: the same exchanges with no compute) as a share;
and the overlap fraction (serial - overlapped) / alone: the wall time that sending the next
block while computing on this one saved, over the transfers' own time, from ABBA-ordered
prefills with and without overlap (median of each). On 2 shared cores the ring is expected to be slower than
one process: N processes share the same two cores and the work is not smaller, only spread.
Prints one JSON object on the last line and writes bench/results/ring.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/ring.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "ring.json"


def _one_process(model: torch.nn.Module, lengths: list[int], threads: int, conn: Any) -> None:
    """Spawned: the model's own prefill of each length; RSS growth and wall time of each."""
    from transformers import DynamicCache

    from fedge.edge.verifier.ring import _rss_peak, _rss_reset

    torch.set_num_threads(threads)
    tokens = torch.randint(3, 1000, (max(lengths),), generator=torch.Generator().manual_seed(0))
    out = []
    with torch.inference_mode():
        model(input_ids=tokens[None, :64], cache=DynamicCache(), use_cache=True, logits_to_keep=1)
        for length in lengths:
            cache = DynamicCache()
            before = _rss_reset()
            started = time.perf_counter()
            model(input_ids=tokens[None, :length], cache=cache, use_cache=True, logits_to_keep=1)
            wall = time.perf_counter() - started
            out.append({"length": length, "wall_s": wall, "peak_rss_delta": _rss_peak() - before})
            del cache
    conn.send(out)


def one_process(model: torch.nn.Module, lengths: list[int], threads: int) -> list[dict[str, Any]]:
    context = torch.multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_one_process, args=(model, lengths, threads, child))
    process.start()
    result: list[dict[str, Any]] = parent.recv()
    process.join()
    return result


def ring(
    model: torch.nn.Module, size: int, lengths: list[int], block: int, threads: int, repeats: int
) -> dict[str, Any]:
    """Prefills of each length on a ring of `size`, per-rank stats, and the transfers alone."""
    from fedge.edge.verifier.batching import KVGeometry
    from fedge.edge.verifier.ring import RingConfig, RingPool

    geometry = KVGeometry.of(model)  # type: ignore[arg-type]
    config = RingConfig(
        size=size, threshold=2 * size, block=block, kv_cap_bytes=1 << 40, threads=threads
    )
    pool = RingPool(model, config, geometry.bytes_per_position)
    tokens = torch.randint(3, 1000, (max(lengths),), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    pool.start()
    start_s = time.perf_counter() - started
    try:
        warm, _ = pool.prefill(tokens[:64].tolist())
        pool.release(warm)
        runs = []
        for length in lengths:
            started = time.perf_counter()
            kv, _ = pool.prefill(tokens[:length].tolist())
            wall = time.perf_counter() - started
            pool.release(kv)
            runs.append({"length": length, "wall_s": wall, "ranks": pool.last_stats})
        alone = pool.probe(max(lengths), geometry.layers, geometry.heads, geometry.head_dim)
        ab: dict[str, list[float]] = {"overlap": [], "serial": []}
        for arm in ["overlap", "serial", "serial", "overlap"] * repeats:  # ABBA: drift hits both
            started = time.perf_counter()
            kv, _ = pool.prefill(tokens.tolist(), overlap=arm == "overlap")
            ab[arm].append(time.perf_counter() - started)
            pool.release(kv)
    finally:
        pool.stop()
    return {"size": size, "start_s": start_s, "runs": runs, "comm_alone_s": alone, "ab": ab}


def longest(points: list[tuple[int, int]], budget: int) -> int:
    """Tokens at which the line through two (length, bytes) points reaches `budget`."""
    (l1, p1), (l2, p2) = sorted(points)
    slope = (p2 - p1) / (l2 - l1)
    if slope <= 0:
        return -1  # not measurable at these lengths (noise above the growth)
    return int(l2 + (budget - p2) / slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="micro", help="zoo preset (micro, demo, default)")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--repeats", type=int, default=1, help="ABBA blocks of overlapped vs serial prefills"
    )
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by every process spawned from here on

    from _common import loadavg, write_result

    from fedge.models import load_causal_lm
    from fedge.zoo import ensure_zoo

    model = load_causal_lm(ensure_zoo(args.preset).target_dir)
    lengths = [args.length // 2, args.length]
    load_before = loadavg()
    base = one_process(model, lengths, args.threads)
    budget = int(base[-1]["peak_rss_delta"])
    curve: dict[str, Any] = {
        "1": longest([(r["length"], r["peak_rss_delta"]) for r in base], budget)
    }
    sizes = [int(s) for s in args.sizes.split(",")]
    rings: dict[str, Any] = {}
    for size in sizes:
        measured = ring(model, size, lengths, args.block, args.threads, args.repeats)
        overlapped = statistics.median(measured["ab"]["overlap"])
        serial = statistics.median(measured["ab"]["serial"])
        full = measured["runs"][-1]
        ranks = full["ranks"]
        peak = max(int(r["peak_rss_delta"]) for r in ranks)
        wait = max(float(r["wait_s"]) for r in ranks)
        alone = max(measured["comm_alone_s"])
        points = [
            (run["length"], max(int(r["peak_rss_delta"]) for r in run["ranks"]))
            for run in measured["runs"]
        ]
        curve[str(size)] = longest(points, budget)
        rings[str(size)] = {
            "peak_rss_delta_per_rank_max": peak,
            "peak_rss_delta_per_rank": [int(r["peak_rss_delta"]) for r in ranks],
            "kv_bytes_per_rank": [int(r["kv_bytes"]) for r in ranks],
            "memory_ratio_vs_one_process": peak / budget if budget else None,
            "wall_s": full["wall_s"],
            "wall_ratio_vs_one_process": full["wall_s"] / base[-1]["wall_s"],
            "rank_wall_s": [float(r["wall_s"]) for r in ranks],
            "rank_compute_s": [float(r["compute_s"]) for r in ranks],
            "rank_exposed_comm_s": [float(r["wait_s"]) for r in ranks],
            "exposed_comm_share": wait / full["wall_s"],
            "comm_alone_s": measured["comm_alone_s"],
            "comm_alone_share": alone / full["wall_s"],
            "wall_s_overlapped_median": overlapped,
            "wall_s_serial_median": serial,
            # time the overlap saved over the transfers' own time (1 = every transfer hidden)
            "overlap_fraction": max(0.0, min(1.0, (serial - overlapped) / alone))
            if alone
            else None,
            "bytes_sent_per_rank": [int(r["bytes_sent"]) for r in ranks],
            "ring_start_s": measured["start_s"],
            "points": points,
        }
    write_result(
        RESULTS,
        {
            "bench": "ring",
            "preset": args.preset,
            "length": args.length,
            "block": args.block,
            "threads_per_process": args.threads,
            "memory_measure": "per-process peak RSS growth during the prefill (VmHWM reset via "
            "clear_refs; glibc mmap threshold 64 KiB); weights excluded",
            "one_process": {
                "peak_rss_delta": budget,
                "wall_s": base[-1]["wall_s"],
                "points": [(r["length"], r["peak_rss_delta"]) for r in base],
            },
            "ring": rings,
            "goals": {"memory_ratio_n2": 0.6, "memory_ratio_n4": 0.35},
            "longest_prompt_per_worker_budget": {"budget_bytes": budget, "tokens_by_n": curve},
            "note": "on 2 shared cores N ring processes share the cores: wall time is expected "
            "above one process; exposed comm includes waiting on a slower neighbour",
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
    )


if __name__ == "__main__":
    main()
