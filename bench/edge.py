"""Benchmark edge-cloud decoding through an emulated network: routes, router, capacity, faults.

Every byte between edge and verifier crosses `fedge.simulations.netem`, a userspace TCP proxy that
delays each direction by RTT/2 (`tc netem` does not exist on these machines' kernel); the
verifier is a child process (`fedge verifier serve`, one torch thread).

1. Per request at RTT 0, 20, 50, 100, 200 ms: edge-only, speculative, cloud-only and the
   router (one router learning online across the whole run): tokens/s, TTFT, target passes
   per token, wire bytes per token (at the proxy), network round trips per token, cost per
   token in the router's units, and whether the service objective is met. The router is
   compared with the best fixed route: the cheapest route that meets the objective.
2. Capacity at RTT 20 and 100 ms: the most concurrent devices one verifier serves while every
   device meets the objective, for cloud-only, speculative and the router. Devices replay
   drafts recorded beforehand and wait the draft's measured step time
   (`fedge.simulations.edge_devices`), so they cost the verifier what real devices cost and the
   machine almost nothing; the proxy runs in its own process. Also measured: whether a target
   pass over k+1 tokens costs about one pass or k+1 (the CPU's regime).
3. Faults: 16 devices decoding speculatively while the verifier is killed (SIGKILL) and
   restarted behind the proxy: requests finished in the cloud, finished on the device after
   the verifier was lost mid-request, decoded on the device while it was down, failed, and
   whether every token the verifier produced equals the target's greedy output.

4. A pretrained target (``--preset smollm2``: SmolLM2-135M under $FEDGE_HOME/models, or
   ``--target DIR [--draft DIR]``): the verifier runs the target on ONNX Runtime, and the
   baseline is plain ONNX Runtime greedy decoding of the same graph in process (one thread, as
   the verifier), measured again just before each RTT's routes; every route's tokens/s is also
   given over it, each route's greedy output is checked against it, and the verifier
   process's CPU per token is recorded. RTTs 0, 20 and
   100 ms, capacity at 20 ms, no regime or faults unless asked.

Usage: ``python bench/edge.py [--quick] [--preset auto|micro|demo|default|smollm2]
[--target DIR --draft DIR]``; the last line printed is one JSON object, also written to
``bench/results/edge.json`` (``edge_quick.json`` with ``--quick``; ``edge_smollm2.json``,
``edge_smollm2_quick.json`` for a pretrained target). A reduced run of some routes, no router:
``--routes speculative --rtts 0,20 --skip regime,capacity,faults --results PATH``. Every run also
reports ``per_request.speculative_floor``: the fewest round trips per token this draft allows
(drafting the verifier's maximum every round along the target's greedy path).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench._common import rounded
from fedge.simulations.verifier_process import VerifierProcess

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "edge.json"
PROMPT_TOKENS = 32
ROUTES = ("edge-only", "speculative", "cloud-only")
MAX_DRAFT = 16  # the verifier's (`VerifierProcess` serves with --max-draft 16)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


PRETRAINED = {"smollm2": "smollm2-135m"}  # preset -> its folder under $FEDGE_HOME/models


def pick_models(args: Any) -> tuple[str, Path, Path, bool]:
    """(name, target dir, draft dir, pretrained): a zoo (`pick_zoo`), or a pretrained target
    (`--preset smollm2`, or `--target DIR`) with its draft (`--draft DIR`, default the
    `fedge models draft` folder beside the target)."""
    from fedge.paths import fedge_home

    if args.target is None and args.preset not in PRETRAINED:
        if args.draft is not None:
            raise SystemExit("--draft needs --target DIR or a pretrained preset (smollm2)")
        name, zoo = pick_zoo(args.preset)
        return name, Path(zoo.target_dir), Path(zoo.draft_dir), False
    target = args.target or fedge_home() / "models" / PRETRAINED[args.preset]
    draft = args.draft or target.with_name(target.name + "-draft")
    if not (target / "config.json").is_file():
        raise SystemExit(f"no model at {target}: `fedge models fetch smollm2-135m` first")
    if not (draft / "config.json").is_file():
        raise SystemExit(f"no draft at {draft}: `fedge models draft --target {target}` first")
    return (args.preset if args.preset in PRETRAINED else target.name), target, draft, True


def plain_ort_baseline(
    model: Any, prompts: list[list[int]], new_tokens: int, threads: int = 1
) -> tuple[dict[str, Any], list[list[int]]]:
    """Plain ONNX Runtime greedy decoding of the target on the verifier's graph (`threads`
    intra-op threads, as the verifier runs), in process: its figures and each prompt's tokens
    (the reference every route's output is checked against)."""
    from bench._common import plain_ort_same_graph

    runs = plain_ort_same_graph(model, prompts, new_tokens, threads)
    seconds = sum(prefill + per * (len(tokens) - 1) for tokens, prefill, per in runs)
    figures = {
        "tokens_per_s": sum(len(tokens) for tokens, _, _ in runs) / seconds,  # prefill included
        "prefill_s_mean": float(np.mean([prefill for _, prefill, _ in runs])),
        "decode_ms_per_token": float(np.mean([per for _, _, per in runs])) * 1e3,
    }
    return figures, [tokens for tokens, _, _ in runs]


def pick_zoo(preset: str) -> Any:
    """The requested zoo; `auto` = default when complete, else demo, else micro."""
    from fedge.paths import zoo_dir
    from fedge.zoo import ZooPaths, ensure_zoo, zoo_problems

    if preset != "auto":
        paths = ZooPaths(zoo_dir(preset))
        if preset == "default" and zoo_problems(paths):
            raise SystemExit("the default zoo is not built: `fedge models build --preset default`")
        return preset, ensure_zoo(preset)
    for name in ("default", "demo"):
        if not zoo_problems(ZooPaths(zoo_dir(name))):
            return name, ZooPaths(zoo_dir(name))
    return "micro", ensure_zoo("micro")


class ProxyProcess:
    """`python -m fedge.simulations.netem` in its own process, so dozens of devices do not share its GIL."""

    def __init__(self, target_port: int, rtt_ms: float) -> None:
        command = [
            *(
                sys.executable,
                "-m",
                "fedge.simulations.netem",
                "--target",
                f"127.0.0.1:{target_port}",
            ),
            *("--rtt-ms", str(rtt_ms)),
        ]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        match = re.search(r"127\.0\.0\.1:(\d+) ->", self.proc.stdout.readline())
        if not match:
            self.stop()
            raise RuntimeError("the network emulator did not start")
        self.port = int(match.group(1))

    def stop(self) -> None:
        """SIGTERM to its pid."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)


# ---------------------------------------------------------------- figures
def route_cost(per_token: dict[str, float]) -> float:
    """Cost per token in the router's units (default weights and device)."""
    from fedge.edge.router import DeviceState, RouterConfig

    cfg, dev = RouterConfig(), DeviceState()
    joules = (
        per_token["drafted"] * dev.joules_per_draft_token + per_token["bytes"] * dev.joules_per_byte
    )
    return (
        cfg.pass_cost * per_token["passes"]
        + cfg.byte_cost * per_token["bytes"]
        + cfg.joule_cost * dev.energy_weight * joules
    )


def summarize(reports: list[Any], wire_bytes: int, objective: Any) -> dict[str, Any]:
    """Totals of a set of requests turned into per-request and per-token figures."""
    tokens = sum(r.tokens for r in reports)
    seconds = sum(r.seconds for r in reports)
    ttfts = [r.ttft_s for r in reports]
    per_token = {
        "passes": sum(r.rounds for r in reports) / tokens,
        "bytes": wire_bytes / tokens,
        "drafted": sum(r.drafted for r in reports) / tokens,
    }
    out = {
        "tokens_per_s": tokens / seconds,
        "ttft_s_mean": float(np.mean(ttfts)),
        "ttft_s_p90": float(np.percentile(ttfts, 90)),
        "target_passes_per_token": per_token["passes"],
        "wire_bytes_per_token": per_token["bytes"],
        "payload_bytes_per_token": sum(r.bytes_up + r.bytes_down for r in reports) / tokens,
        "round_trips_per_token": sum(r.round_trips for r in reports) / tokens,
        "one_way_messages_per_token": sum(r.one_way for r in reports) / tokens,
        "tokens_per_verify": (
            sum(r.tokens for r in reports if r.route == "speculative")
            / max(1, sum(r.rounds for r in reports if r.route == "speculative"))
        ),
        "cost_per_token": route_cost(per_token),
        "acceptance": sum(r.acceptance * r.drafted for r in reports if r.route == "speculative")
        / max(1, sum(r.drafted for r in reports if r.route == "speculative")),
        "draft_len_mean": sum(r.drafted for r in reports if r.route == "speculative")
        / max(1, sum(r.rounds for r in reports if r.route == "speculative")),
        "routes": sorted({r.route for r in reports}),
        "reasons": sorted({r.reason for r in reports}),
    }
    out["meets_objective"] = (
        out["tokens_per_s"] >= objective.tokens_per_s and out["ttft_s_p90"] <= objective.ttft_s
    )
    return out


def compare(
    routes: dict[str, dict[str, Any]], router: dict[str, Any], objective: Any
) -> dict[str, Any]:
    """The router against the best fixed route the objective allows (edge-only only when the
    draft suffices), by the router's own rule: the cheapest meeting the objective unless a
    route meeting it is `clearly_faster` (RouterConfig), else the fastest."""
    from fedge.edge.router import RouterConfig

    allowed = ROUTES if objective.draft_ok else tuple(r for r in ROUTES if r != "edge-only")
    meeting = [r for r in allowed if routes[r]["meets_objective"]]
    if meeting:
        best = min(meeting, key=lambda r: routes[r]["cost_per_token"])
        fastest = max(meeting, key=lambda r: routes[r]["tokens_per_s"])
        if (
            routes[fastest]["tokens_per_s"]
            >= RouterConfig().clearly_faster * routes[best]["tokens_per_s"]
        ):
            best = fastest
        ratio = (
            routes[best]["cost_per_token"] / router["cost_per_token"]
            if router["meets_objective"]
            else 0.0
        )
    else:
        best = max(allowed, key=lambda r: routes[r]["tokens_per_s"])
        ratio = router["tokens_per_s"] / routes[best]["tokens_per_s"]
    return {
        "best_fixed_route": best,
        "some_route_meets": bool(meeting),
        "router_meets": router["meets_objective"],
        "router_on_objective_vs_best": ratio,  # goal >= 0.95 (cost ratio when met, else speed)
        "router_tokens_per_s_vs_best": router["tokens_per_s"] / routes[best]["tokens_per_s"],
    }


# ---------------------------------------------------------------- 1. per request
def per_request(
    runtime: Any,
    server: VerifierProcess,
    prompts: list[list[int]],
    args: Any,
    objective: Any,
    reference: list[list[int]] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Each route and the router at each RTT, through one in-process proxy.

    Also per route: the verifier process's CPU per generated token, and, given `reference` (the
    target's plain greedy tokens of each prompt), whether the route's output equals it (edge-only
    is the draft's own output, never checked). Each route's tokens/s is divided by every
    baseline in `args.baselines` (plain greedy tokens/s measured in the same run); with
    `args.measure_baseline` (a pretrained target) that baseline is measured again just before
    each RTT's routes, and the ratios at that RTT are to it (a shared machine's load drifts)."""
    from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient
    from fedge.edge.decoder import DecodeConfig
    from fedge.edge.router import Router
    from fedge.simulations.netem import LinkConfig, NetworkEmulator

    floor = {} if args.confidence_floor is None else {"confidence_floor": args.confidence_floor}
    decode = DecodeConfig(max_new_tokens=args.new_tokens, **floor)
    out: dict[str, Any] = {"confidence_floor": decode.confidence_floor}
    router = Router()
    with NetworkEmulator(server.port) as netem:
        target = f"127.0.0.1:{netem.port}"

        def run(route: str | None, edge: EdgeClient) -> dict[str, Any]:
            wire0, cpu0 = netem.bytes_up + netem.bytes_down, cpu_seconds(server.proc.pid)
            reports, predicted, identical = [], [], []
            for i, prompt in enumerate(prompts):
                if route is None:  # what the router expected of each route (choose() is pure)
                    edge.measure_rtt()
                    p = edge.router.choose(objective).predicted
                    predicted.append({r.value: round(v.tokens_per_s, 1) for r, v in p.items()})
                produced = [t for chunk in edge.stream_ids(prompt, route) for t in chunk]
                reports.append(copy.copy(edge.last))
                if reference is not None and edge.last.route != "edge-only":
                    identical.append(produced == reference[i][: len(produced)])
            out = summarize(reports, netem.bytes_up + netem.bytes_down - wire0, objective)
            tokens = sum(r.tokens for r in reports)
            out["verifier_cpu_ms_per_token"] = (cpu_seconds(server.proc.pid) - cpu0) / tokens * 1e3
            for name, tokens_per_s in args.baselines.items():
                out[f"over_{name}"] = out["tokens_per_s"] / tokens_per_s
            if identical:
                out["identical_to_plain_greedy"] = all(identical)
            return {**out, "predicted_tokens_per_s": predicted} if route is None else out

        out["speculative_floor"] = speculative_floor(runtime, server, prompts, args.new_tokens)
        with VerifierClient(ClientConfig(target)) as client:
            learner = EdgeClient(runtime, None, client, decode, router, objective)
            for _ in range(3 if tuple(args.routes) == ROUTES else 0):  # each route measured once
                for _ in learner.stream_ids(prompts[0]):
                    pass
            for rtt in args.rtts:
                adjacent = {}
                if args.measure_baseline is not None:
                    adjacent = args.measure_baseline()
                    args.baselines = {"plain_ort_greedy": adjacent["tokens_per_s"]}
                netem.set_link(LinkConfig(rtt_s=rtt / 1e3))
                learner.measure_rtt(force=True)  # a device learns of a network change
                fixed = {}
                for route in args.routes:
                    with VerifierClient(ClientConfig(target)) as own:
                        edge = EdgeClient(runtime, None, own, decode, Router())
                        for _ in edge.stream_ids(prompts[-1], route):  # warm, as a device is:
                            pass  # connected, limits known, draft-length model fed
                        fixed[route] = run(route, edge)
                if tuple(args.routes) != ROUTES:  # a reduced run: those routes, no router
                    out[f"{rtt:g}ms"] = {**fixed}
                    print_rtt(rtt, fixed)
                    continue
                chosen = run(None, learner)
                out[f"{rtt:g}ms"] = {
                    **({"plain_ort_greedy": adjacent} if adjacent else {}),
                    **fixed,
                    "router": chosen,
                    **compare(fixed, chosen, objective),
                    "speculative_over_cloud_only": fixed["speculative"]["tokens_per_s"]
                    / fixed["cloud-only"]["tokens_per_s"],
                    "router_over_cloud_only": chosen["tokens_per_s"]
                    / fixed["cloud-only"]["tokens_per_s"],
                }
                if rtt == 0 and "plain_hf_greedy" in args.baselines:
                    out["cloud_only_0ms_over_plain_hf_greedy"] = fixed["cloud-only"][
                        "over_plain_hf_greedy"
                    ]
                print_rtt(rtt, fixed, chosen)
    return out, router


def print_rtt(rtt: float, fixed: dict[str, Any], chosen: dict[str, Any] | None = None) -> None:
    """One progress line: each route's tokens/s at this RTT, and the router's when it ran."""
    line = ", ".join(f"{r} {fixed[r]['tokens_per_s']:.0f}/s" for r in fixed)
    if chosen is not None:
        line += f", router {chosen['tokens_per_s']:.0f}/s via {chosen['routes']}"
    print(f"rtt {rtt:g} ms: {line}", file=sys.stderr)


def speculative_floor(
    runtime: Any, server: VerifierProcess, prompts: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    """The fewest verifies greedy speculative decoding of `prompts` can make with this draft.

    Along the target's greedy path, a verify at position p with draft length k accepts
    min(run(p), k), where run(p) is how many of the draft's own greedy tokens after path[:p]
    match the path; drafting the verifier's `MAX_DRAFT` every round (capped, as the decoder
    does, so a request ends on its last token) makes the fewest verifies, since run(p + j) =
    run(p) - j inside a run. No draft-length policy does better: round trips per token at any
    RTT are at least `round_trips_per_token` here (issue 34's goal is <= 0.25 at 20 ms)."""
    from fedge.edge.client import ClientConfig, VerifierClient
    from fedge.simulations.edge_devices import ReplayTable

    verifies, agreed, positions = 0, 0, 0
    with VerifierClient(ClientConfig(f"127.0.0.1:{server.port}")) as direct:
        for prompt in prompts:
            path = list(direct.generate(prompt, new_tokens))
            table = ReplayTable.record(runtime, prompt, path, MAX_DRAFT)
            runs = []
            for p in range(len(prompt), len(table.path)):
                own, want = table.continuations[p - len(prompt)], table.path[p:]
                pairs = enumerate(zip(own, want, strict=False))
                runs.append(next((i for i, (a, b) in pairs if a != b), min(len(own), len(want))))
            agreed += sum(run > 0 for run in runs)
            positions += len(runs)
            made = 0
            while made < len(path):
                k = min(MAX_DRAFT, len(path) - made - 1)
                made += min(runs[made], k) + 1
                verifies += 1
    return {
        "max_draft": MAX_DRAFT,
        "draft_agreement_on_target_path": agreed / positions,
        "verifies_per_request": verifies / len(prompts),
        "round_trips_per_token": verifies / (len(prompts) * new_tokens),
    }


def router_estimates(router: Any) -> dict[str, Any]:
    """What the run's router believes at the end: each route's estimates (what its choices came
    from) and the draft-length model's."""
    est = router.speculation
    c0, c1 = est.call_line
    return {
        "rtt_s": router.state.rtt_s,  # the round trip the router last saw (shortest recent call)
        **{
            route.value: {
                "requests": s.n,
                "tokens_per_s": 1.0 / s.seconds if s.seconds else 0.0,
                "ttft_s": s.ttft_s,
                "passes_per_token": s.passes,
                "rtt_s": s.rtt_s,
                # what the speed check compares: tokens/s as observed, and the RTT it ran at
                "observed_tokens_per_s": s.observed.tokens_per_s,
                "observed_rtt_s": s.observed.rtt_s,
            }
            for route, s in router.state.stats.items()
            if s.n
        },
        "speculation": {
            "verifies": est.verifies,
            "acceptance": est.acceptance,
            "draft_step_ms": est.draft_step_s * 1e3,
            "call_ms_beyond_rtt": c0 * 1e3 - est.rtt_s * 1e3,
            "call_ms_per_drafted_token": c1 * 1e3,
        },
    }


def plain_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> float:
    """Plain Hugging Face greedy decoding of the target, in process (1 thread): the fair cloud."""
    import torch

    from fedge.models import load_causal_lm

    model = load_causal_lm(model_dir)

    def generate(prompt: list[int]) -> int:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        return int(out.shape[1]) - len(prompt)

    generate(prompts[0])  # warm up, as the verifier is warm before its routes are timed
    tokens, started = 0, time.perf_counter()
    for prompt in prompts:
        tokens += generate(prompt)
    return tokens / (time.perf_counter() - started)


# ---------------------------------------------------------------- 2. capacity
def verifier_costs(preset: str, prompt_len: int = 64) -> dict[str, Any]:
    """What verifying and streaming cost the verifier for one zoo's target (1 torch thread).

    Pass CPU times on the engine's own paths after a `prompt_len`-token past: a lone session's
    pass over n new tokens in place on its cache object (then cropped back, as a lone verify
    does), and a padded batch of B sessions (the copies a batch makes included). Then the
    verifier process's CPU per Verify (4-token greedy drafts) and per streamed Generate token
    (batched replies as the edge client asks, and one reply per token), one caller on
    loopback: what a message costs beyond its pass.
    """
    import torch
    from transformers import DynamicCache

    from fedge.edge import _hf
    from fedge.edge.verifier.batching import KVGeometry, batched_forward
    from fedge.models import load_causal_lm
    from fedge.zoo import ensure_zoo

    zoo = ensure_zoo(preset)
    model = load_causal_lm(zoo.target_dir)
    vocab = int(model.config.vocab_size)
    geometry = KVGeometry.of(model)
    torch.manual_seed(0)
    past = torch.randint(4, vocab, (1, prompt_len))

    def median_ms(run: Any, repeats: int = 9) -> float:
        """Median CPU time of `run` (this thread does all the work with 1 torch thread, so a
        shared machine's preemption does not count)."""
        samples = []
        for _ in range(repeats):
            tick = time.thread_time()
            run()
            samples.append(time.thread_time() - tick)
        return float(np.median(samples[2:])) * 1e3

    lengths, batches = (1, 5, 9, 17), (1, 8, 32)
    pass_ms: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        cache = DynamicCache()
        _hf.forward_on(model, past, cache)
        for batch in batches:
            row = {}
            for n in lengths:
                new = torch.randint(4, vocab, (batch, n))
                if batch == 1:

                    def lone(new: Any = new, n: int = n) -> None:
                        _hf.forward_on(model, new, cache)
                        _hf.drop_last(cache, n)

                    row[str(n)] = median_ms(lone)
                else:
                    inputs = new.tolist()
                    row[str(n)] = median_ms(
                        lambda inputs=inputs: batched_forward(
                            model, geometry, [cache] * len(inputs), inputs
                        )
                    )
            pass_ms[f"batch{batch}"] = row
    single = pass_ms["batch1"]["1"]
    out: dict[str, Any] = {
        "preset": preset,
        "target_parameters": sum(p.numel() for p in model.parameters()),
        "past_tokens": prompt_len,
        "pass_ms": pass_ms,
        "k_plus_1_in_passes": {
            b: {n: t / pass_ms[b]["1"] for n, t in row.items()} for b, row in pass_ms.items()
        },
        "batch_of_streams_in_passes": {str(b): pass_ms[f"batch{b}"]["1"] / single for b in batches},
    }
    out.update(message_costs(zoo.target_dir, past[0].tolist()[:32]))
    out["overhead_ms_per_verify"] = out["server_cpu_ms_per_verify"] - pass_ms["batch1"]["5"]
    out["overhead_ms_per_generate_token"] = out["server_cpu_ms_per_generate_token"] - single
    ratio = out["k_plus_1_in_passes"]["batch1"]["5"]
    out["regime"] = (
        "overhead/memory-bound: verifying k+1 tokens costs about one pass"
        if ratio < 2.0
        else "compute-bound: verifying k+1 tokens costs about k+1 passes"
        if ratio > 3.5
        else "between: verifying k+1 tokens costs a fraction of k+1 passes"
    )
    return out


def message_costs(model_dir: Path, prompt: list[int], calls: int = 200) -> dict[str, float]:
    """The verifier process's CPU (user + system) per Verify and per streamed Generate token."""
    import grpc

    from fedge.edge.proto import verifier_pb2 as pb
    from fedge.edge.proto import verifier_pb2_grpc as pb_grpc

    server = VerifierProcess(model_dir)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.VerifierStub(channel)
            for batch in (False, True):  # warm up
                for _ in stub.Generate(
                    pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=8, batch_tokens=batch)
                ):
                    pass
            per_token = {}
            for batch in (False, True):  # one reply per token (older clients), or a few tokens
                before = cpu_seconds(server.proc.pid)
                request = pb.GenerateRequest(
                    prompt_ids=prompt, max_new_tokens=calls, batch_tokens=batch
                )
                for _ in stub.Generate(request):
                    pass
                per_token[batch] = (cpu_seconds(server.proc.pid) - before) / calls
            rounds, used = 0, 0.0
            while rounds < calls:  # sessions of 20 verifies, so the past stays near the prompt's
                sid = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt)).session_id
                before = cpu_seconds(server.proc.pid)
                for _ in range(20):
                    stub.Verify(pb.VerifyRequest(session_id=sid, draft_ids=[5, 6, 7, 8]))
                used += cpu_seconds(server.proc.pid) - before
                rounds += 20
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    finally:
        server.stop()
    return {
        "server_cpu_ms_per_verify": used / rounds * 1e3,
        "server_cpu_ms_per_generate_token": per_token[True] * 1e3,  # as the edge client asks
        "server_cpu_ms_per_generate_token_one_per_reply": per_token[False] * 1e3,
    }


def _cpu_of(usage: Any) -> float:
    """User + system seconds of a `resource.getrusage` result."""
    return float(usage.ru_utime + usage.ru_stime)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def capacity(
    tables: list[Any],
    step_s: float,
    server: VerifierProcess,
    args: Any,
    objective: Any,
    router: Any,
) -> dict[str, Any]:
    """Max devices meeting the objective per route at each capacity RTT.

    Each trial also records the CPU the verifier process and the bench process (the emulated
    devices) used per second of the trial: a verifier near 1.0 (its one torch thread) is the
    limit; a bench process near 1.0 means the devices' emulation limited that trial instead.
    """
    import resource

    from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient
    from fedge.edge.decoder import DecodeConfig
    from fedge.edge.router import Router
    from fedge.simulations.edge_devices import (
        ReplayRuntime,
        RequestFigures,
        devices_meeting,
        max_devices,
        run_devices,
    )

    decode = DecodeConfig(max_new_tokens=args.capacity_tokens)
    out: dict[str, Any] = {}
    for rtt in args.capacity_rtts:
        proxy = ProxyProcess(server.port, rtt)
        per_route: dict[str, Any] = {}
        try:
            for route in args.capacity_routes:
                trials: dict[int, Any] = {}

                def trial(
                    n: int,
                    route: str = route,
                    trials: dict[int, Any] = trials,
                    port: int = proxy.port,
                    rtt: float = rtt,
                ) -> bool:
                    edges = []
                    for i in range(n):
                        client = VerifierClient(ClientConfig(f"127.0.0.1:{port}"))
                        own = copy.deepcopy(router) if route == "router" else Router()
                        runtime = ReplayRuntime(tables[i % len(tables)], step_s)
                        edges.append(EdgeClient(runtime, None, client, decode, own, objective))

                    def request(i: int, _: int) -> RequestFigures:
                        edge, table = edges[i], tables[i % len(tables)]
                        prompt = list(table.path[: table.prompt_len])
                        try:
                            for _chunk in edge.stream_ids(
                                prompt, None if route == "router" else route
                            ):
                                pass
                            r = edge.last
                            return RequestFigures(
                                i, r.route, r.reason, r.tokens, r.seconds, r.ttft_s, r.round_trips
                            )
                        except Exception as err:  # a failed request counts against the objective
                            return RequestFigures(i, route, "failed", 0, 1.0, 1e9, 0, repr(err))

                    cpu_before = cpu_seconds(server.proc.pid), resource.getrusage(0)
                    wall_before = time.perf_counter()
                    figures = run_devices(n, request, args.capacity_requests, warmup=1)
                    wall = time.perf_counter() - wall_before
                    verifier_cpu = cpu_seconds(server.proc.pid) - cpu_before[0]
                    bench_cpu = _cpu_of(resource.getrusage(0)) - _cpu_of(cpu_before[1])
                    for edge in edges:
                        edge.verifier.close_channel()
                    met, total = devices_meeting(figures, objective.tokens_per_s, objective.ttft_s)
                    tps = [f.tokens / f.seconds for f in figures if f.seconds]
                    trials[n] = {
                        "devices_meeting": met,
                        "tokens_per_s_min": float(min(tps)) if tps else 0.0,
                        "ttft_s_max": float(max(f.ttft_s for f in figures)),
                        "routes": sorted({f.route for f in figures}),
                        "tokens_per_round_trip": sum(f.tokens for f in figures)
                        / max(1, sum(f.round_trips for f in figures)),
                        "verifier_cpu_per_s": verifier_cpu / wall,
                        "devices_cpu_per_s": bench_cpu / wall,
                        "load": loadavg()[0],
                    }
                    print(f"capacity rtt {rtt:g} ms {route} x{n}: {met}/{total}", file=sys.stderr)
                    return met == total

                best, _ = max_devices(trial, args.capacity_limit)
                per_route[route] = {
                    "max_devices": best,
                    "trials": {str(k): v for k, v in sorted(trials.items())},
                }
        finally:
            proxy.stop()
        cloud = max(1, per_route["cloud-only"]["max_devices"])
        for route in ("speculative", "router"):
            if route in per_route:
                per_route[f"{route}_over_cloud_devices"] = per_route[route]["max_devices"] / cloud
        out[f"{rtt:g}ms"] = per_route
    return out


# ---------------------------------------------------------------- 3. faults
def classify(report: Any, produced: list[int], table: Any) -> dict[str, Any]:
    """Where one request finished, and whether what the verifier produced is the target's."""
    expected = list(table.path[table.prompt_len : table.prompt_len + len(produced)])
    if report.finished_on_device:
        where, cloud = "device_after_loss", report.cloud_tokens
    elif report.route == "edge-only":
        where, cloud = "device_while_down", 0
    else:
        where, cloud = "cloud", len(produced)
    return {"where": where, "exact": produced[:cloud] == expected[:cloud]}


def faults(
    tables: list[Any], step_s: float, server: VerifierProcess, model_dir: Path, args: Any
) -> tuple[dict[str, Any], VerifierProcess]:
    """Kill (SIGKILL) and restart the verifier under speculative devices; classify every request.

    Each device decodes requests back to back; once every device finished one in the cloud the
    verifier is killed and a new one started behind the proxy. A device stops after its first
    request back in the cloud following the restart (or `--fault-patience-s` after it)."""
    import threading

    from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient
    from fedge.edge.decoder import DecodeConfig
    from fedge.edge.router import Router
    from fedge.simulations.edge_devices import ReplayRuntime
    from fedge.simulations.netem import LinkConfig, NetworkEmulator

    decode = DecodeConfig(max_new_tokens=args.capacity_tokens)
    outcomes: list[dict[str, Any]] = []
    lock = threading.Lock()
    restarted = threading.Event()
    restarted_at = [0.0]
    with NetworkEmulator(server.port, LinkConfig(rtt_s=args.fault_rtt_ms / 1e3)) as netem:
        config = ClientConfig(f"127.0.0.1:{netem.port}", timeout_s=5.0)
        edges = [
            EdgeClient(
                ReplayRuntime(tables[i % len(tables)], step_s),
                None,
                VerifierClient(config),
                decode,
                Router(),
                rtt_max_age_s=0.5,
            )
            for i in range(args.fault_devices)
        ]

        def device(i: int) -> None:
            table = tables[i % len(tables)]
            prompt = list(table.path[: table.prompt_len])
            while (
                not restarted.is_set() or time.monotonic() < restarted_at[0] + args.fault_patience_s
            ):
                after = restarted.is_set()
                try:
                    produced = [
                        t for chunk in edges[i].stream_ids(prompt, "speculative") for t in chunk
                    ]
                    row = {**classify(edges[i].last, produced, table), "after": after}
                except Exception as err:  # counted: the goal is none
                    row = {"where": "failed", "error": f"{type(err).__name__}: {err}"[:200]}
                with lock:
                    outcomes.append({**row, "device": i})
                if after and row["where"] == "cloud":
                    return
                if row["where"] != "cloud":
                    restarted.wait(0.2)  # on the device: leave the CPUs to the restart

        threads = [
            threading.Thread(target=device, args=(i,), daemon=True)
            for i in range(args.fault_devices)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                if len({o["device"] for o in outcomes if o["where"] == "cloud"}) == len(threads):
                    break
            time.sleep(0.01)
        server.kill()
        killed_at = time.perf_counter()
        server = VerifierProcess(model_dir, runtime=args.verifier_runtime)
        netem.retarget(server.port)
        restart_s = time.perf_counter() - killed_at
        restarted_at[0] = time.monotonic()
        restarted.set()
        for thread in threads:
            thread.join(args.fault_patience_s + 60)
        for edge in edges:
            assert edge.verifier is not None
            edge.verifier.close_channel()
    count = {w: sum(o["where"] == w for o in outcomes) for w in ("cloud", "device_after_loss")}
    back = {o["device"] for o in outcomes if o.get("after") and o["where"] == "cloud"}
    return (
        {
            "devices": args.fault_devices,
            "rtt_ms": args.fault_rtt_ms,
            "requests": len(outcomes),
            "finished_in_cloud": count["cloud"],
            "finished_on_device_after_loss": count["device_after_loss"],
            "decoded_on_device_while_down": sum(
                o["where"] == "device_while_down" for o in outcomes
            ),
            "failed": sum(o["where"] == "failed" for o in outcomes),  # goal 0
            "errors": sorted({o["error"] for o in outcomes if "error" in o})[:5],
            "verified_tokens_exact": all(o.get("exact", True) for o in outcomes),
            "devices_back_in_cloud": len(back),
            "restart_s": restart_s,
        },
        server,
    )


# ---------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="auto", help="auto|micro|demo|default|smollm2")
    parser.add_argument(
        "--target", type=Path, default=None, help="a pretrained target folder (not a zoo)"
    )
    parser.add_argument(
        "--draft", type=Path, default=None, help="its draft (default: TARGET-draft beside it)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer RTTs, prompts and devices")
    # acceptance varies widely across held-out code prompts (13 of 147 to 38 of 46 drafted tokens
    # kept by the SmolLM2 draft): speculative over plain was 1.06x on 4 prompts, 1.20x on 16
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rtts", default=None, help="ms (default 0,20,50,100,200; 0,20,100)")
    parser.add_argument(
        "--routes",
        default=",".join(ROUTES),
        help="fixed routes of the per-request part (a subset skips the router and its ratios)",
    )
    parser.add_argument("--capacity-rtts", default=None, help="ms (default 20,100; 20)")
    parser.add_argument("--capacity-limit", type=int, default=None, help="default 128; 8")
    parser.add_argument("--capacity-tokens", type=int, default=32)
    parser.add_argument("--capacity-requests", type=int, default=2)
    parser.add_argument(
        "--capacity-routes", default="cloud-only,speculative,router", help="routes to size"
    )
    parser.add_argument("--tokens-per-s", type=float, default=15.0, help="objective")
    parser.add_argument("--ttft-s", type=float, default=1.0, help="objective")
    parser.add_argument("--fault-devices", type=int, default=16)
    parser.add_argument("--fault-rtt-ms", type=float, default=20.0)
    parser.add_argument(
        "--fault-patience-s", type=float, default=60.0, help="after the restart, per device"
    )
    parser.add_argument(
        "--skip",
        default=None,
        help="comma-separated parts to skip: regime,routes,capacity,faults (default: none; "
        "regime,faults for a pretrained target)",
    )
    parser.add_argument(
        "--regime-presets",
        default="",
        help="zoos whose verifier costs to measure (default: --preset's)",
    )
    parser.add_argument(
        "--confidence-floor",
        type=float,
        default=None,
        help="greedy drafting stops below this draft confidence (default: DecodeConfig's)",
    )
    parser.add_argument(
        "--verifier-threads",
        type=int,
        default=1,
        help="a pretrained target's intra-op threads, in the verifier and its plain ORT baseline "
        "alike (default 1)",
    )
    parser.add_argument(
        "--results", default="", help="file name under bench/results (default edge.json)"
    )
    args = parser.parse_args()
    name, target_dir, draft_dir, pretrained = pick_models(args)
    if args.verifier_threads < 1 or (args.verifier_threads > 1 and not pretrained):
        parser.error(
            "--verifier-threads must be >= 1, and above 1 only with a pretrained target (a zoo's "
            "plain HF baseline runs 1 thread)"
        )
    # a pretrained target (SmolLM2-135M: ~30 ms a token) is sized down: the RTTs of issue 34,
    # capacity at 20 ms only, no torch pass-cost regime (a zoo's) and no fault injection
    defaults = (
        {"rtts": "0,20,100", "capacity_rtts": "20", "capacity_limit": 8, "skip": "regime,faults"}
        if pretrained
        else {"rtts": "0,20,50,100,200", "capacity_rtts": "20,100", "capacity_limit": 128}
    )
    if args.quick:
        defaults |= {"rtts": "0,100", "capacity_rtts": "100", "capacity_limit": 8}
        args.prompts, args.fault_devices = 2, 4
        if pretrained:
            defaults |= {"rtts": "0,20,100", "skip": "regime,capacity,faults"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.skip = args.skip or ""
    if pretrained and not args.results:  # a zoo's figures keep edge.json
        args.results = f"edge_{name}{'_quick' if args.quick else ''}.json"
    args.rtts = [float(x) for x in args.rtts.split(",")]
    asked = set(filter(None, args.routes.split(",")))
    if not asked or asked - set(ROUTES):
        parser.error(f"--routes takes some of {','.join(ROUTES)}, got {args.routes!r}")
    args.routes = [r for r in ROUTES if r in asked]
    args.capacity_rtts = [float(x) for x in args.capacity_rtts.split(",")]
    args.capacity_routes = [r for r in args.capacity_routes.split(",") if r]
    if "cloud-only" not in args.capacity_routes:
        parser.error("--capacity-routes must include cloud-only, the baseline of the ratios")
    skip = set(filter(None, args.skip.split(",")))

    import torch

    from fedge.edge.client import ClientConfig, VerifierClient
    from fedge.edge.export import ExportConfig, export_draft
    from fedge.edge.prompts import heldout_prompts
    from fedge.edge.router import Objective
    from fedge.edge.runtime import load_draft_runtime
    from fedge.models import load_tokenizer
    from fedge.simulations.edge_devices import ReplayTable

    torch.set_num_threads(1)
    objective = Objective(args.tokens_per_s, args.ttft_s)
    pool = heldout_prompts(load_tokenizer(target_dir), 8 + args.prompts + 8, PROMPT_TOKENS)
    prompts, replay_prompts = pool[8 : 8 + args.prompts], pool[8 + args.prompts :]
    result: dict[str, Any] = {
        "preset": name,
        "target": str(target_dir),
        "draft": str(draft_dir),
        "quick": args.quick,
        "objective": {"tokens_per_s": objective.tokens_per_s, "ttft_s": objective.ttft_s},
        "new_tokens": args.new_tokens,
        "network": "userspace TCP proxy (fedge.simulations.netem): each direction delayed by RTT/2",
        "load_start": loadavg(),
    }
    started = time.perf_counter()
    if "regime" not in skip:
        result["verifier_costs"] = {}
        for zoo_name in filter(None, (args.regime_presets or name).split(",")):
            print(f"preset {zoo_name}: measuring what verifies and streams cost", file=sys.stderr)
            result["verifier_costs"][zoo_name] = verifier_costs(zoo_name)
        result["load_after_regime"] = loadavg()
    if {"routes", "capacity", "faults"} <= skip:
        finish(result, started, args)
        return
    work = Path(tempfile.mkdtemp(prefix="fedge-bench-edge-"))
    manifest = export_draft(draft_dir, work / "draft", pool[:8], ExportConfig(), target_dir)
    runtime = load_draft_runtime(work / "draft", "auto", threads=1)
    result["draft_runtime"] = runtime.name
    result["draft_step_ms_by_variant"] = {
        n: v["decode_step_s"] * 1e3 for n, v in manifest["variants"].items() if v.get("valid")
    }
    reference, args.measure_baseline = None, None
    if pretrained:  # the verifier on ONNX Runtime, against plain ORT greedy of the same graph
        from fedge.models import load_causal_lm

        target = load_causal_lm(target_dir).eval()
        threads = args.verifier_threads
        result["verifier_threads"] = threads
        result["plain_ort_greedy"], reference = plain_ort_baseline(
            target, prompts, args.new_tokens, threads
        )
        args.baselines = {"plain_ort_greedy": result["plain_ort_greedy"]["tokens_per_s"]}
        args.measure_baseline = lambda: plain_ort_baseline(
            target, prompts, args.new_tokens, threads
        )[0]
        verifier_runtime = "onnx"
    else:  # a zoo's verifier on torch, against plain HF greedy
        args.plain_tokens_per_s = plain_greedy(target_dir, prompts, args.new_tokens)
        result["plain_hf_greedy_tokens_per_s"] = args.plain_tokens_per_s
        args.baselines = {"plain_hf_greedy": args.plain_tokens_per_s}
        verifier_runtime = "torch"
    result["verifier_runtime"] = args.verifier_runtime = verifier_runtime
    server = VerifierProcess(
        target_dir, runtime=verifier_runtime, torch_threads=args.verifier_threads
    )
    try:
        router = None
        if "routes" not in skip:
            result["per_request"], router = per_request(
                runtime, server, prompts, args, objective, reference
            )
            result["router_estimates"] = router_estimates(router)
            result["load_after_per_request"] = loadavg()
        with VerifierClient(ClientConfig(f"127.0.0.1:{server.port}")) as direct:
            depth, tables, steps = 16, [], []
            for prompt in replay_prompts:
                target = list(direct.generate(prompt, args.capacity_tokens + 1))
                tick = time.perf_counter()
                tables.append(ReplayTable.record(runtime, prompt, target, depth))
                steps.append((time.perf_counter() - tick) / (len(target) + 1) / depth)
        step_s = float(np.median(steps))
        if "capacity" not in skip:
            from fedge.edge.router import Router

            result["capacity"] = {
                "devices": (
                    "emulated: each replays the draft's greedy proposals recorded beforehand "
                    "along the target's greedy path and sleeps the measured draft step "
                    f"({step_s * 1e3:.2f} ms) per draft call; real EdgeClient, decoder, router, "
                    "gRPC and proxy; one thread per device in the bench process"
                ),
                "requests_per_device": args.capacity_requests,
                "tokens_per_request": args.capacity_tokens,
                "by_rtt": capacity(tables, step_s, server, args, objective, router or Router()),
            }
            result["load_after_capacity"] = loadavg()
        if "faults" not in skip:
            result["faults"], server = faults(tables, step_s, server, target_dir, args)
    finally:
        server.stop()
    finish(result, started, args)


def finish(result: dict[str, Any], started: float, args: Any) -> None:
    """Stamp the load and wall time, print the JSON line and write it to bench/results."""
    result["load_end"] = loadavg()
    result["wall_s"] = time.perf_counter() - started
    line = json.dumps(rounded(result))
    results = RESULTS_FILE.with_name("edge_quick.json") if args.quick else RESULTS_FILE
    if args.results:  # a bare name goes under bench/results, a path where it says
        results = (
            Path(args.results) if os.sep in args.results else RESULTS_FILE.with_name(args.results)
        )
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
