"""Benchmark edge-cloud speculative decoding against cloud-only and edge-only decoding, side by side.

1. Speculative (int8 ONNX draft on the edge, verifier over gRPC) vs cloud-only (the
   verifier's own token stream) vs edge-only (the draft alone), at an added round-trip
   time of 0, 20 and 100 ms: tokens/s at the edge, target passes per token, acceptance,
   protobuf payload bytes up and down per token. The RTT is simulated on the client: it
   sleeps for the RTT before every unary call and once before a stream (edge.client).
2. Hugging Face `generate(assistant_model=draft)` on the same model pair, in process, as a
   peer baseline (target passes counted with a forward hook), beside plain `generate`.
3. int8 against fp32 ONNX draft: decode step time, edge-only speed, acceptance.
4. Verifier capacity: 32 concurrent sessions replaying draft-length-4 verifies, batched
   (max batch 32, 2 ms window) against one-at-a-time (max batch 1): aggregate tokens/s
   and p50/p99 verify latency.

The verifier runs as a separate process (`fedge verifier serve`, one torch thread), the
edge in this process (one thread). Usage: ``python bench/edge.py [--preset auto|micro|demo|default]
[--prompts 6] [--new-tokens 48] [--rtts 0,20,100] [--sessions 32] [--rounds 12]``; `auto`
takes the default zoo when it is built, else demo, else micro. The last line printed is
one JSON object, also written to ``bench/results/edge.json``.
"""

from __future__ import annotations

import argparse
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

# `python bench/edge.py` puts bench/ first on sys.path, where this file would shadow the `edge` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "edge.json"
PROMPT_TOKENS = 32
DRAFT_LEN = 4


def pick_zoo(preset: str) -> Any:
    """The requested zoo; `auto` = the largest already built (never triggers the long default build)."""
    from fedge.paths import zoo_dir
    from fedge.zoo import ZooPaths, ensure_zoo, zoo_problems

    if preset != "auto":
        paths = ZooPaths(zoo_dir(preset))
        if preset == "default" and zoo_problems(paths):
            raise SystemExit(
                "the default zoo is not built: run `fedge models build --preset default` first"
            )
        return preset, ensure_zoo(preset)
    for name in ("default", "demo"):
        if not zoo_problems(ZooPaths(zoo_dir(name))):
            return name, ZooPaths(zoo_dir(name))
    return "micro", ensure_zoo("micro")


class VerifierProcess:
    """`fedge verifier serve` in a child process on 127.0.0.1:0; stopped by SIGTERM to its pid."""

    def __init__(self, model_dir: Path, max_batch: int) -> None:
        command = [
            sys.executable,
            "-m",
            "fedge.cli",
            "verifier",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--max-batch",
            str(max_batch),
            "--batch-window-ms",
            "2",
            "--torch-threads",
            "1",
            "--grace-s",
            "1",
            "--max-draft",
            "16",
        ]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r":(\d+)$", line.strip())
        if not match:
            self.stop()
            raise RuntimeError(f"verifier did not start: {line!r}")
        self.target = f"127.0.0.1:{match.group(1)}"

    def stop(self) -> None:
        """SIGTERM, then wait for the drain."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)


# ---------------------------------------------------------------- 1. routes x RTT
def speculative_run(
    runtime: Any, client: Any, prompts: list[list[int]], new_tokens: int
) -> dict[str, float]:
    """Greedy speculative decoding of every prompt; totals turned into rates."""
    from edge.decoder import DecodeConfig, SpeculativeDecoder

    tokens = rounds = drafted = accepted = 0
    seconds = 0.0
    up0, down0 = client.bytes_up, client.bytes_down
    for prompt in prompts:
        decoder = SpeculativeDecoder(
            runtime, client, DecodeConfig(max_new_tokens=new_tokens, draft_len=DRAFT_LEN)
        )
        decoder.generate(prompt)
        s = decoder.stats
        tokens, rounds, seconds = tokens + s.tokens, rounds + s.rounds, seconds + s.seconds
        drafted, accepted = drafted + s.drafted, accepted + s.accepted
    return {
        "tokens_per_s": tokens / seconds,
        "target_passes_per_token": rounds / tokens,
        "acceptance": accepted / max(1, drafted),
        "bytes_up_per_token": (client.bytes_up - up0) / tokens,
        "bytes_down_per_token": (client.bytes_down - down0) / tokens,
    }


def cloud_run(client: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """The verifier's own greedy stream for every prompt."""
    tokens, seconds = 0, 0.0
    up0, down0 = client.bytes_up, client.bytes_down
    for prompt in prompts:
        started = time.perf_counter()
        tokens += sum(1 for _ in client.generate(prompt, new_tokens))
        seconds += time.perf_counter() - started
    return {
        "tokens_per_s": tokens / seconds,
        "target_passes_per_token": 1.0,
        "bytes_up_per_token": (client.bytes_up - up0) / tokens,
        "bytes_down_per_token": (client.bytes_down - down0) / tokens,
    }


def edge_run(runtime: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """The draft alone, greedy, no network."""
    from edge.decoder import DecodeConfig, edge_only

    tokens, started = 0, time.perf_counter()
    for prompt in prompts:
        tokens += sum(
            1 for _ in edge_only(runtime, prompt, DecodeConfig(max_new_tokens=new_tokens))
        )
    return {
        "tokens_per_s": tokens / (time.perf_counter() - started),
        "target_passes_per_token": 0.0,
    }


# ---------------------------------------------------------------- 2. HF assisted generation
def hf_assisted(zoo: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """`generate(assistant_model=draft)` vs plain `generate`, greedy, same prompts, in process."""
    import torch

    from fedge.models import load_causal_lm

    target, draft = load_causal_lm(zoo.target_dir), load_causal_lm(zoo.draft_dir)
    calls = [0]
    target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    figures: dict[str, float] = {}
    for name, extra in (("plain", {}), ("assisted", {"assistant_model": draft})):
        tokens, calls[0], started = 0, 0, time.perf_counter()
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                **extra,
            )
            tokens += out.shape[1] - len(prompt)
        figures[f"{name}_tokens_per_s"] = tokens / (time.perf_counter() - started)
        figures[f"{name}_target_passes_per_token"] = calls[0] / tokens
    return figures


# ---------------------------------------------------------------- 4. capacity
def capacity_run(
    target: str, continuations: list[list[int]], prompts: list[list[int]], rounds: int
) -> dict[str, float]:
    """All sessions at once, each replaying DRAFT_LEN-token drafts taken from the target's own
    greedy continuation with one token corrupted in half of the rounds (so acceptance is
    partial and the committed path stays on the target's); aggregate tokens/s and verify
    latency. One asyncio loop drives every session, so the load generator stays light.
    """
    import asyncio

    import grpc

    from edge.proto import verifier_pb2 as pb
    from edge.proto import verifier_pb2_grpc as pb_grpc

    latencies: list[float] = []
    produced = [0] * len(prompts)

    async def session(stub: pb_grpc.VerifierStub, i: int, start: asyncio.Event) -> None:
        rng = np.random.default_rng(i)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompts[i]))).session_id
        await start.wait()
        position = 0
        for _ in range(rounds):
            draft = list(continuations[i][position : position + DRAFT_LEN])
            if rng.random() < 0.5:
                j = int(rng.integers(DRAFT_LEN))
                draft[j] = (draft[j] + 1) % 256
            started = time.perf_counter()
            reply = await stub.Verify(pb.VerifyRequest(session_id=sid, draft_ids=draft))
            latencies.append(time.perf_counter() - started)
            position += reply.accepted + 1
            produced[i] += reply.accepted + 1
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))

    async def run() -> float:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.VerifierStub(channel)
            start = asyncio.Event()
            tasks = [asyncio.create_task(session(stub, i, start)) for i in range(len(prompts))]
            await asyncio.sleep(0.5)  # let every session open (prefill) before the clock starts
            started = time.perf_counter()
            start.set()
            await asyncio.gather(*tasks)
            return time.perf_counter() - started

    wall = asyncio.run(run())
    lat = np.array(latencies) * 1e3
    return {
        "aggregate_tokens_per_s": sum(produced) / wall,
        "verify_p50_ms": float(np.percentile(lat, 50)),
        "verify_p99_ms": float(np.percentile(lat, 99)),
        "tokens_per_verify": sum(produced) / len(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="auto")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rtts", default="0,20,100", help="added round-trip times, ms")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from edge.client import ClientConfig, VerifierClient
    from edge.export import ExportConfig, export_draft
    from edge.prompts import heldout_prompts
    from edge.runtime import load_draft_runtime
    from fedge.models import load_tokenizer

    torch.set_num_threads(1)
    console = Console(stderr=True)
    preset, zoo = pick_zoo(args.preset)
    tokenizer = load_tokenizer(zoo.target_dir)
    pool = heldout_prompts(tokenizer, 8 + args.prompts + args.sessions, PROMPT_TOKENS)
    prompts = pool[8 : 8 + args.prompts]
    session_prompts = [p[:16] for p in pool[8 + args.prompts :]]
    result: dict[str, Any] = {
        "preset": preset,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "draft_len": DRAFT_LEN,
        "rtt_method": "client sleeps the RTT before each unary call and once before a stream",
    }
    work = Path(tempfile.mkdtemp(prefix="fedge-bench-edge-"))
    with console.status("exporting the draft (fp32 + int8)"):
        manifest = export_draft(zoo.draft_dir, work / "draft", pool[:8], ExportConfig())
    int8 = load_draft_runtime(work / "draft", "onnx-int8", threads=1)
    fp32 = load_draft_runtime(work / "draft", "onnx-fp32", threads=1)

    console.print(f"[bold]preset {preset}[/bold]: starting the batched verifier")
    server = VerifierProcess(zoo.target_dir, max_batch=32)
    try:
        result["edge_only"] = edge_run(int8, prompts, args.new_tokens)
        result["rtt"] = {}
        for rtt in [float(x) for x in args.rtts.split(",")]:
            with VerifierClient(ClientConfig(server.target, added_rtt_s=rtt / 1e3)) as client:
                spec = speculative_run(int8, client, prompts, args.new_tokens)
                cloud = cloud_run(client, prompts, args.new_tokens)
            result["rtt"][f"{rtt:g}ms"] = {
                "speculative": spec,
                "cloud_only": cloud,
                "speculative_over_cloud_tokens_per_s": spec["tokens_per_s"] / cloud["tokens_per_s"],
                "cloud_passes_saved": 1.0 - spec["target_passes_per_token"],
            }
            console.print(
                f"rtt {rtt:g} ms: speculative {spec['tokens_per_s']:.0f} tok/s, cloud-only {cloud['tokens_per_s']:.0f} tok/s"
            )
        with VerifierClient(ClientConfig(server.target)) as client:
            fp32_spec = speculative_run(fp32, client, prompts, args.new_tokens)
            int8_spec = speculative_run(int8, client, prompts, args.new_tokens)
            continuations = [
                list(client.generate(p, args.rounds * (DRAFT_LEN + 1) + 1)) for p in session_prompts
            ]
        fp32_edge = edge_run(fp32, prompts, args.new_tokens)
        result["draft_int8_vs_fp32"] = {
            variant: {
                "decode_step_ms": manifest["variants"][variant]["decode_step_s"] * 1e3,
                "greedy_agreement_with_torch": manifest["variants"][variant]["greedy_agreement"],
                "bytes": manifest["variants"][variant]["bytes"],
                "edge_only_tokens_per_s": edge["tokens_per_s"],
                "speculative_tokens_per_s": spec["tokens_per_s"],
                "acceptance": spec["acceptance"],
            }
            for variant, edge, spec in (
                ("int8", result["edge_only"], int8_spec),
                ("fp32", fp32_edge, fp32_spec),
            )
        }
        result["draft_int8_vs_fp32"]["int8_over_fp32_edge_speed"] = (
            result["edge_only"]["tokens_per_s"] / fp32_edge["tokens_per_s"]
        )
        console.print("capacity: batched verifier, 32 sessions")
        batched = capacity_run(server.target, continuations, session_prompts, args.rounds)
    finally:
        server.stop()
    console.print("capacity: one-at-a-time verifier, 32 sessions")
    single_server = VerifierProcess(zoo.target_dir, max_batch=1)
    try:
        single = capacity_run(single_server.target, continuations, session_prompts, args.rounds)
    finally:
        single_server.stop()
    result["capacity"] = {
        "sessions": args.sessions,
        "rounds_per_session": args.rounds,
        "batched": batched,
        "one_at_a_time": single,
        "batched_over_one_at_a_time": batched["aggregate_tokens_per_s"]
        / single["aggregate_tokens_per_s"],
    }
    with console.status("Hugging Face assisted generation (in process)"):
        hf = hf_assisted(zoo, prompts, args.new_tokens)
    hf["ours_rtt0_over_hf_assisted_tokens_per_s"] = (
        result["rtt"][next(iter(result["rtt"]))]["speculative"]["tokens_per_s"]
        / hf["assisted_tokens_per_s"]
    )
    result["hf_assisted"] = hf
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(_rounded(result))
    RESULTS_FILE.write_text(line + "\n")
    print(line)


def _rounded(value: Any) -> Any:
    """Round floats to 4 significant decimals for a readable JSON line."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main()
