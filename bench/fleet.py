"""Verifier fleet benchmark: load-balancing policies under a mixed load, a replica kill, 1 vs 2 replicas.

Mixed load: concurrent edge devices, each its own process (`bench/_fleet_devices.py`:
threads of one process never queued at the replicas), each request a short (8 tokens)
or long (96 tokens) prompt, speculative (the zoo's draft on the "device", greedy) or
cloud-only (Generate stream), through the fleet's gRPC ingress. Per request: time to
first token, inter-token latency ((end-to-end - TTFT) / (tokens - 1), as genai-bench),
end-to-end latency; per run: tokens/s. Each p50 and p99.

Runs: first 1 vs 2 replicas without a slowed one (does a second replica add throughput?
if not, the load does not queue, and a policy gains only by keeping sessions off a slowed
replica; the 1-replica run's p99 is what placing every session on the fast replica gives);
then round robin vs least-outstanding vs token-aware (`--policies`), all with session
affinity, each under the same load in `--blocks` blocks (2) run ABBA, so a machine that
drifts over the run weighs on each policy alike, with the rank-0 replica answering every call
`--slowdown` times as late (4x). The slowed replica is late, not busy: it sleeps (slowdown
- 1) x each call's own time, so it takes no CPU from the rest, and calls it holds overlap
(a replica on a slower accelerator that batches alike, or farther away). Per policy the
calls, sessions and tokens each replica got, summed over the ingresses, and each replica's
verify p50 as each ingress saw it, so the run shows what the policy chose and that the
slowed replica was slowed. Then token-aware with a replica killed a third of the way in
(failed requests counted; a lost session is reopened from its committed tokens, as the
edge's recovery does), and a rolling restart (every replica replaced) likewise.
`--secure` puts the ingress on TLS with a token per device; `--ingress-replicas 2` runs two
ingresses on one port sharing their state through a local Redis.
Usage: python bench/fleet.py [--quick | --smoke | --policies-only] [--secure]
[--ingress-replicas 2] [--sessions N] [--policies round-robin token-aware ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

import numpy as np

from bench._common import block_order
from bench._fleet_devices import DevicePool, Endpoint, Load, Record
from bench._fleet_setup import secure_material
from fedge.edge.fleet.app import Fleet, FleetConfig, ensure_serve, start_fleet
from fedge.edge.prompts import heldout_prompts
from fedge.edge.verifier.engine import EngineConfig
from fedge.models import load_tokenizer
from fedge.simulations.local_services import redis_server
from fedge.zoo import ensure_zoo

RESULTS = Path(__file__).parent / "results" / "fleet.json"
SHORT, LONG = 8, 96
SCALING_FLOOR = 1.3  # 2 replicas below this x 1 replica's tokens/s: the load does not queue
POLICIES = ("round-robin", "least-outstanding", "token-aware")
INGRESS_TRIES = 64  # handle calls to reach every ingress (each goes to one at random)


def loadavg() -> list[float]:
    """The machine's 1/5/15-minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds."""
    if not values:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    arr = np.asarray(values) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99))}


def summarize(records: list[Record], wall: float) -> dict[str, Any]:
    """TTFT, ITL, end-to-end (p50/p99), tokens/s, requests, failures, reopened sessions."""
    ok = [r for r in records if r.ok]
    itl = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "reopened_sessions": sum(r.reopened for r in ok),
        "by_route": {
            route: sum(r.route == route for r in ok) for route in ("speculative", "cloud-only")
        },
        "tokens_per_s": sum(r.tokens for r in ok) / wall,
        "ttft": percentiles([r.ttft for r in ok]),
        "itl": percentiles(itl),
        "itl_by_route": {
            route: percentiles(
                [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.route == route and r.tokens > 1]
            )
            for route in ("speculative", "cloud-only")
        },
        "e2e": percentiles([r.e2e for r in ok]),
        "wall_s": wall,
    }


def from_each_ingress(fleet: Fleet, method: str, count: int) -> list[Any]:
    """`method`'s answer from each of the fleet's `count` ingresses.

    Each ingress keeps its own figures, and the handle sends a call to any one of them,
    so the call is repeated until every ingress has answered (an answer names its
    ingress: `reset_stats` returns its process id, `fleet_stats` holds it as "ingress").
    """
    answers: dict[int, Any] = {}
    for _ in range(INGRESS_TRIES):
        answer = getattr(fleet.ingress, method).remote().result()
        answers[answer["ingress"] if isinstance(answer, dict) else answer] = answer
        if len(answers) == count:
            return list(answers.values())
    raise RuntimeError(f"{len(answers)} of {count} ingresses answered {method}")


def replica_choices(fleet: Fleet, stats: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per replica: the calls, sessions and tokens the policy sent it (over every ingress),
    its added delay, and its verify p50 as each ingress saw it."""
    slowdowns = {}
    for replica in fleet.replica_actors():
        try:
            slowdowns[replica] = fleet.call_replica(replica, "slowed_by")
        except Exception:  # a replica killed or replaced meanwhile
            slowdowns[replica] = None
    by_replica: dict[str, list[dict[str, Any]]] = {}
    for ingress in stats:
        for replica, figures in ingress["replicas"].items():
            by_replica.setdefault(replica, []).append(figures)
    return {
        replica: {
            "slowdown": slowdowns.get(replica),
            **{key: sum(f[key] for f in figures) for key in ("calls", "sessions", "tokens")},
            "verify_p50_ms_by_ingress": [f["verify"]["p50_ms"] for f in figures],
        }
        for replica, figures in by_replica.items()
    }


def run_block(
    config: FleetConfig,
    pool: DevicePool,
    endpoint: Endpoint,
    args: argparse.Namespace,
    duration_s: float,
    seed: int,
    event: str = "",
) -> dict[str, Any]:
    """Deploy a fleet, warm it up, load it `duration_s`, tear it down; the raw block.

    `event` "kill" kills a replica a third of the way in, "restart" restarts every replica
    then (Serve's rolling update, `Fleet.restart`).
    """
    import ray

    from fedge.ports import free_port

    endpoint = replace(endpoint, port=free_port("127.0.0.1"))  # never a stopped fleet's port
    fleet = start_fleet(replace(config, port=endpoint.port))
    try:
        pool.run(endpoint, args.warmup, seed=0)
        from_each_ingress(fleet, "reset_stats", config.ingress_replicas)
        restarted: dict[str, Any] = {}

        def kill() -> None:
            name = sorted(fleet.replica_actors().values())[0]
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

        def restart() -> None:
            restarted.update(fleet.restart())

        hooks = {"kill": kill, "restart": restart}
        load_before = loadavg()
        records, wall = pool.run(endpoint, duration_s, seed=seed, event=hooks.get(event))
        stats = from_each_ingress(fleet, "fleet_stats", config.ingress_replicas)
        return {
            "records": records,
            "wall": wall,
            "loadavg": (load_before, loadavg()),
            "stats": stats,
            "per_replica": replica_choices(fleet, stats),
            "restarted": restarted,
        }
    finally:
        fleet.stop()


def by_slowdown(per_replica: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Calls, sessions and tokens summed per replica slowdown (the slowed arm against the rest),
    over every block's replicas (each block deploys its own)."""
    totals: dict[str, dict[str, int]] = {}
    for figures in per_replica.values():
        arm = totals.setdefault(str(figures["slowdown"]), {"calls": 0, "sessions": 0, "tokens": 0})
        for key in arm:
            arm[key] += figures[key]
    return totals


def summarize_blocks(blocks: list[dict[str, Any]], label: str, event: str = "") -> dict[str, Any]:
    """One summary over blocks of the same setup: their requests pooled, their walls summed."""
    records = [r for block in blocks for r in block["records"]]
    summary = summarize(records, sum(block["wall"] for block in blocks))
    summary["loadavg_before"] = blocks[0]["loadavg"][0]
    summary["loadavg_after"] = blocks[-1]["loadavg"][1]
    summary["per_replica"] = {k: v for block in blocks for k, v in block["per_replica"].items()}
    summary["by_slowdown"] = by_slowdown(summary["per_replica"])
    print(label, "per replica:", json.dumps(summary["per_replica"]), flush=True)
    stats = [s for block in blocks for s in block["stats"]]
    if event:
        summary["resumed_streams"] = sum(s["resumed_streams"] for s in stats)
        summary["moved_sessions"] = sum(s["moved_sessions"] for s in stats)
    restarted = {k: v for block in blocks for k, v in block["restarted"].items()}
    if restarted:
        summary["restart"] = restarted
    print(label, json.dumps({k: v for k, v in summary.items() if k != "per_replica"}), flush=True)
    return summary


def measure(
    config: FleetConfig,
    pool: DevicePool,
    endpoint: Endpoint,
    args: argparse.Namespace,
    label: str,
    event: str = "",
) -> dict[str, Any]:
    """One block of `args.duration` seconds, summarized."""
    block = run_block(config, pool, endpoint, args, args.duration, seed=1, event=event)
    return summarize_blocks([block], label, event)


def compare_policies(
    config: FleetConfig,
    pool: DevicePool,
    endpoint: Endpoint,
    args: argparse.Namespace,
    policies: tuple[str, ...],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each policy over `args.blocks` interleaved blocks of `args.duration` seconds.

    Every block deploys its own fleet, so token-aware learns the replicas' speeds afresh in
    each; blocks as long as the single run's keep that cold start as rare as it was. Block i
    of every policy replays the same requests (seed 1 + i). Returns the pooled summary per
    policy and each block's ITL p99 and tokens/s, in the order they ran.
    """
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    timeline = []
    for block, policy in block_order(policies, args.blocks):
        raw = run_block(
            replace(config, policy=policy),
            pool,
            endpoint,
            args,
            args.duration,
            seed=1 + block,
        )
        runs[policy].append(raw)
        one = summarize(raw["records"], raw["wall"])
        timeline.append(
            {
                "block": block,
                "policy": policy,
                "itl_p99_ms": one["itl"]["p99_ms"],
                "tokens_per_s": one["tokens_per_s"],
                "loadavg_before": raw["loadavg"][0],
            }
        )
        print(json.dumps(timeline[-1]), flush=True)
    return {policy: summarize_blocks(runs[policy], policy) for policy in policies}, timeline


@contextlib.contextmanager
def fleet_setup(
    args: argparse.Namespace, base: FleetConfig, workdir: Path
) -> Iterator[tuple[FleetConfig, Endpoint]]:
    """The fleet config and endpoint: TLS and tokens with --secure, Redis with several ingresses."""
    config, endpoint = base, Endpoint(0)
    if args.secure:
        secure = secure_material(workdir, args.sessions)
        config = replace(
            config, credentials_file=secure.credentials, tls_cert=secure.cert, tls_key=secure.key
        )
        endpoint = replace(endpoint, root_cert=secure.cert, tokens=secure.tokens)
    with contextlib.ExitStack() as stack:
        if args.ingress_replicas > 1:
            redis = stack.enter_context(redis_server(workdir))
            config = replace(
                config,
                redis_url=redis.url,
                redis_password_file=redis.password_file,
                ingress_replicas=args.ingress_replicas,
            )
        yield config, endpoint


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="micro", help="zoo preset (target and draft)")
    parser.add_argument("--sessions", type=int, default=12, help="concurrent edge devices")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--slowdown",
        type=float,
        default=4.0,
        help="the slowed (rank-0) replica answers every call this many times as late",
    )
    parser.add_argument("--long-share", type=float, default=0.3)
    parser.add_argument("--speculative-share", type=float, default=0.7)
    parser.add_argument("--secure", action="store_true", help="TLS and a token per device")
    parser.add_argument("--ingress-replicas", type=int, default=1, help="ingresses (2+: Redis)")
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help="policies to compare; the ratio needs round-robin and token-aware",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=2,
        help="blocks of --duration seconds per policy, the policies interleaved (ABBA)",
    )
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long runs of 2 devices, round robin vs token-aware only, nothing written",
    )
    parser.add_argument(
        "--policies-only",
        action="store_true",
        help="rerun the scaling check and policies; keep the kill and restart figures on file",
    )
    args = parser.parse_args()
    if not {"round-robin", "token-aware"} <= set(args.policies):
        parser.error("--policies must include round-robin and token-aware (the ratio's terms)")
    if args.quick:
        args.duration, args.sessions = 8.0, 6
    if args.smoke:
        args.duration, args.warmup, args.sessions, args.new_tokens = 2.0, 1.0, 2, 8
    return args


def main() -> None:
    args = parse_args()
    zoo = ensure_zoo(args.preset)
    base_prompts = heldout_prompts(load_tokenizer(zoo.target_dir), 16, LONG)
    prompts = {"short": [p[:SHORT] for p in base_prompts], "long": base_prompts}
    load = Load(args.new_tokens, args.long_share, args.speculative_share)
    pool = DevicePool(args.sessions, zoo.draft_dir, prompts, load)
    ensure_serve()
    base = FleetConfig(
        zoo.target_dir, replicas=2, replica_cpus=0.0, engine=EngineConfig(max_draft=12)
    )
    policy_names = ("round-robin", "token-aware") if args.smoke else tuple(args.policies)
    try:
        with (
            tempfile.TemporaryDirectory() as workdir,
            fleet_setup(args, base, Path(workdir)) as (fleet, endpoint),
        ):
            scaling = {
                str(n): measure(replace(fleet, replicas=n), pool, endpoint, args, f"{n} replica(s)")
                for n in (1, 2)
            }
            ratio = scaling["2"]["tokens_per_s"] / max(scaling["1"]["tokens_per_s"], 1e-9)
            print(f"2 replicas / 1 replica tokens/s: {ratio:.2f}x", flush=True)
            if ratio < SCALING_FLOOR:
                print(
                    f"note: a second replica added under {SCALING_FLOOR}x throughput: the load "
                    "does not queue at one replica (or the cores are taken), so a policy gains "
                    "only by keeping sessions off the slowed replica, not by spreading load",
                    flush=True,
                )
            slowed = replace(fleet, slowdown=args.slowdown)
            policies, timeline = compare_policies(slowed, pool, endpoint, args, policy_names)
            killed: dict[str, Any] = {}
            restarted: dict[str, Any] = {}
            if args.policies_only:
                previous = json.loads(RESULTS.read_text())
                killed, restarted = previous["replica_kill"], previous.get("rolling_restart", {})
            elif not args.smoke:
                killed = measure(fleet, pool, endpoint, args, "kill", event="kill")
                restarted = measure(fleet, pool, endpoint, args, "restart", event="restart")
    finally:
        pool.close()
    rr, aware = policies["round-robin"], policies["token-aware"]
    result = {
        "bench": "fleet",
        "preset": args.preset,
        "load": {
            "sessions": args.sessions,
            "devices_as": "processes",
            "duration_s": args.duration,
            "policy_blocks": args.blocks,
            "new_tokens": args.new_tokens,
            "prompts": {"short": SHORT, "long": LONG, "long_share": args.long_share},
            "speculative_share": args.speculative_share,
            "slowdown_rank0": args.slowdown,
            "secure": args.secure,
            "ingress_replicas": args.ingress_replicas,
        },
        "replicas": scaling,
        "throughput_ratio_2_over_1": ratio,
        "policies": policies,
        "policy_blocks": timeline,
        "itl_p99_ratio_rr_over_token_aware": rr["itl"]["p99_ms"]
        / max(aware["itl"]["p99_ms"], 1e-9),
        "itl_p99_ratio_rr_over_one_replica": rr["itl"]["p99_ms"]
        / max(scaling["1"]["itl"]["p99_ms"], 1e-9),
        "goal_itl_p99_ratio": 1.5,
        "replica_kill": killed,
        "rolling_restart": restarted,
        "cpu_cores": os.cpu_count(),
        "note": "replicas, ingress and the emulated devices' drafts share this machine's cores",
    }
    if "least-outstanding" in policies:
        result["itl_p99_ratio_rr_over_least_outstanding"] = rr["itl"]["p99_ms"] / max(
            policies["least-outstanding"]["itl"]["p99_ms"], 1e-9
        )
    if not args.smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
