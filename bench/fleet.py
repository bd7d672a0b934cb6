"""Verifier fleet benchmark: load-balancing policies under a mixed load, a replica kill, 1 vs 2 replicas.

Mixed load: concurrent edge sessions in threads, each request short (8 tokens) or
long (96 tokens) prompt, speculative (the zoo's draft on the "device", greedy) or
cloud-only (Generate stream), through the fleet's gRPC ingress. Two replicas, the
rank-0 one slowed (its forward passes take `--slowdown` times as long). Per
request: time to first token, inter-token latency ((end-to-end - TTFT) / (tokens
- 1), as genai-bench), end-to-end latency; per run: tokens/s. Each p50 and p99.

Runs: round robin vs least-outstanding vs token-aware, all with session affinity
(a speculative session's KV cache lives on one replica); then token-aware with a
replica killed a third of the way in (failed requests counted; a lost session is
reopened from its committed tokens, as the edge's recovery does); then 1 vs 2
replicas without slowdown. A rolling restart (every replica replaced, Serve's rolling
update) a third of the way into a token-aware run counts failed requests too.
Usage: python bench/fleet.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

import grpc
import numpy as np
import torch

from edge.client import ClientConfig, VerifierClient
from edge.decoder import DecodeConfig, SpeculativeDecoder
from edge.fleet.app import FleetConfig, ensure_serve, start_fleet
from edge.prompts import heldout_prompts
from edge.runtime import TorchDraftRuntime
from edge.verifier.engine import EngineConfig
from fedge.models import load_causal_lm, load_tokenizer
from fedge.zoo import ensure_zoo

RESULTS = Path(__file__).parent / "results" / "fleet.json"
SHORT, LONG = 8, 96


@dataclass
class Record:
    """One request's figures (seconds)."""

    route: str
    tokens: int
    ttft: float
    e2e: float
    ok: bool
    reopened: int = 0
    error: str = ""


def loadavg() -> list[float]:
    """The machine's 1/5/15-minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def speculative(
    client: VerifierClient, draft: Any, prompt: list[int], n: int
) -> tuple[list[float], int]:
    """Greedy speculative decoding; a lost session (NOT_FOUND) reopens from the committed tokens.

    Returns the arrival time of each token and how often the session was reopened.
    """
    arrivals: list[float] = []
    reopened = 0
    while len(arrivals) < n:
        committed = len(arrivals)
        decoder = SpeculativeDecoder(
            TorchDraftRuntime(draft), client, DecodeConfig(max_new_tokens=n - committed)
        )
        try:
            for chunk in decoder.stream(prompt):
                now = time.perf_counter()
                arrivals += [now] * len(chunk)
                prompt = prompt + chunk
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise
            reopened += 1
    return arrivals[:n], reopened


def cloud_only(client: VerifierClient, prompt: list[int], n: int) -> list[float]:
    """Generate stream; the arrival time of each token."""
    return [time.perf_counter() for _ in client.generate(prompt, n)]


def session_loop(
    port: int,
    draft: Any,
    prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
    seed: int,
    stop: threading.Event,
    out: list[Record],
) -> None:
    """One edge device: requests back to back until `stop`."""
    rng = random.Random(seed)
    with VerifierClient(ClientConfig(f"127.0.0.1:{port}", timeout_s=120)) as client:
        while not stop.is_set():
            prompt = rng.choice(prompts["long" if rng.random() < args.long_share else "short"])
            route = "speculative" if rng.random() < args.speculative_share else "cloud-only"
            started = time.perf_counter()
            try:
                if route == "speculative":
                    arrivals, reopened = speculative(client, draft, prompt, args.new_tokens)
                else:
                    arrivals, reopened = cloud_only(client, prompt, args.new_tokens), 0
            except Exception as err:  # a failed request is a result of this bench
                out.append(
                    Record(route, 0, 0.0, time.perf_counter() - started, False, 0, repr(err))
                )
                continue
            out.append(
                Record(
                    route,
                    len(arrivals),
                    arrivals[0] - started,
                    arrivals[-1] - started,
                    True,
                    reopened,
                )
            )


def run_load(
    port: int,
    draft: Any,
    prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
    kill: Any = None,
) -> tuple[list[Record], float]:
    """Drive `args.sessions` devices for `args.duration` s (`kill()` runs a third of the way in;
    when it takes long, as a restart does, the load runs on at least a third after it)."""
    stop = threading.Event()
    records: list[Record] = []
    threads = [
        threading.Thread(
            target=session_loop, args=(port, draft, prompts, args, i, stop, records), daemon=True
        )
        for i in range(args.sessions)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    if kill is not None:
        time.sleep(args.duration / 3)
        hooked = time.perf_counter()
        kill()
        spent = time.perf_counter() - hooked
        time.sleep(max(args.duration * 2 / 3 - spent, args.duration / 3))
    else:
        time.sleep(args.duration)
    stop.set()
    for thread in threads:
        thread.join(timeout=300)
    return records, time.perf_counter() - started


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


def measure(
    config: FleetConfig,
    draft: Any,
    prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
    event: str = "",
) -> dict[str, Any]:
    """Deploy a fleet, warm it up, run the load, tear it down.

    `event` "kill" kills a replica a third of the way in, "restart" restarts every replica
    then (Serve's rolling update, `Fleet.restart`).
    """
    import ray

    fleet = start_fleet(config)
    try:
        warm = argparse.Namespace(**{**vars(args), "duration": 3.0})
        run_load(fleet.port, draft, prompts, warm)
        fleet.ingress.reset_stats.remote().result()
        restarted: dict[str, Any] = {}

        def kill() -> None:
            name = sorted(fleet.replica_actors().values())[0]
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

        def restart() -> None:
            restarted.update(fleet.restart())

        hooks = {"kill": kill, "restart": restart}
        load_before = loadavg()
        records, wall = run_load(fleet.port, draft, prompts, args, hooks.get(event))
        summary = summarize(records, wall)
        summary["loadavg_before"], summary["loadavg_after"] = load_before, loadavg()
        stats = fleet.ingress.fleet_stats.remote().result()
        summary["per_replica"] = stats["replicas"]
        if event:
            summary["resumed_streams"] = stats["resumed_streams"]
            summary["moved_sessions"] = stats["moved_sessions"]
        if restarted:
            summary["restart"] = restarted
        return summary
    finally:
        fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="micro", help="zoo preset (target and draft)")
    parser.add_argument("--sessions", type=int, default=12, help="concurrent edge devices")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--slowdown", type=float, default=4.0, help="rank-0 replica's slowdown")
    parser.add_argument("--long-share", type=float, default=0.3)
    parser.add_argument("--speculative-share", type=float, default=0.7)
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    parser.add_argument(
        "--policies-only",
        action="store_true",
        help="rerun the policy comparison only; keep the kill and scaling figures on file",
    )
    args = parser.parse_args()
    if args.quick:
        args.duration, args.sessions = 8.0, 6
    torch.set_num_threads(1)  # the devices' drafts share the two cores with the replicas
    zoo = ensure_zoo(args.preset)
    draft = load_causal_lm(zoo.draft_dir)
    base = heldout_prompts(load_tokenizer(zoo.target_dir), 16, LONG)
    prompts = {"short": [p[:SHORT] for p in base], "long": base}
    ensure_serve()
    fleet = FleetConfig(
        zoo.target_dir,
        replicas=2,
        replica_cpus=0.0,
        slowdown=args.slowdown,
        engine=EngineConfig(max_draft=12),
    )
    policies = {}
    for policy in ("round-robin", "least-outstanding", "token-aware"):
        policies[policy] = measure(replace(fleet, policy=policy), draft, prompts, args)
        print(policy, json.dumps(policies[policy]), flush=True)
    if args.policies_only:
        previous = json.loads(RESULTS.read_text())
        killed, scaling = previous["replica_kill"], previous["replicas"]
        restarted = previous.get("rolling_restart", {})
    else:
        killed = measure(replace(fleet, slowdown=1.0), draft, prompts, args, event="kill")
        print("kill", json.dumps(killed), flush=True)
        restarted = measure(replace(fleet, slowdown=1.0), draft, prompts, args, event="restart")
        print("restart", json.dumps(restarted), flush=True)
        scaling = {
            str(n): measure(replace(fleet, replicas=n, slowdown=1.0), draft, prompts, args)
            for n in (1, 2)
        }
    rr, aware = policies["round-robin"], policies["token-aware"]
    result = {
        "bench": "fleet",
        "preset": args.preset,
        "load": {
            "sessions": args.sessions,
            "duration_s": args.duration,
            "new_tokens": args.new_tokens,
            "prompts": {"short": SHORT, "long": LONG, "long_share": args.long_share},
            "speculative_share": args.speculative_share,
            "slowdown_rank0": args.slowdown,
        },
        "policies": policies,
        "itl_p99_ratio_rr_over_token_aware": rr["itl"]["p99_ms"]
        / max(aware["itl"]["p99_ms"], 1e-9),
        "itl_p99_ratio_rr_over_least_outstanding": rr["itl"]["p99_ms"]
        / max(policies["least-outstanding"]["itl"]["p99_ms"], 1e-9),
        "goal_itl_p99_ratio": 1.5,
        "replica_kill": killed,
        "rolling_restart": restarted,
        "replicas": scaling,
        "throughput_ratio_2_over_1": scaling["2"]["tokens_per_s"]
        / max(scaling["1"]["tokens_per_s"], 1e-9),
        "cpu_cores": os.cpu_count(),
        "note": "replicas, ingress and the emulated devices' drafts share this machine's cores",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
