"""Cloud-only Generate for a lone stream vs plain Hugging Face greedy decoding of the same model.

The ratio (Generate tokens/s over `model.generate` tokens/s, same prompts, same
greedy tokens, same torch threads) is the verifier's per-stream overhead: gRPC on
loopback, the engine's worker thread, KV bookkeeping, metering and fair shares (on by
default). Goal: >= 1.0 (issue 34). The verifier runs as deployed, in its own process
(`fedge verifier serve`), measured two ways in interleaved rounds beside plain decoding (a
shared machine's drift weighs on every arm alike; medians over `--rounds`):

- `generate`: `VerifierClient.generate` straight to the verifier;
- `edge_cloud_only`: an `EdgeClient` on the cloud-only route through the network emulator at
  RTT 0, as `bench/edge.py` measures its cloud-only route (its `cloud_only_0ms_over_plain_hf_greedy`).

Also reported: the verifier's CPU per generated token (user + system, from /proc), against plain
decoding's CPU per token (`cpu_ratio`: plain's over the verifier's, steadier under load), and a verifier in the bench's own process, where the client's thread
competes with the server's for one interpreter lock. Prints one JSON object on the last line and
writes bench/results/generate.json (`--results NAME` for another file there).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's user + system CPU seconds (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="micro", help="zoo preset (micro, demo, default)")
    parser.add_argument(
        "--target",
        type=Path,
        default=None,
        help="a model folder instead of the zoo's target (with its tokenizer): e.g. an untrained "
        "model of the default zoo's shape, whose per-token costs are the trained one's",
    )
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of plain decoding and the verifier"
    )
    parser.add_argument(
        "--results", default="generate.json", help="file name under bench/results, or a path"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient
    from fedge.edge.decoder import DecodeConfig
    from fedge.edge.prompts import heldout_prompts
    from fedge.edge.router import Router
    from fedge.edge.runtime import load_draft_runtime
    from fedge.edge.verifier.server import BackgroundServer, ServerConfig
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.simulations.netem import NetworkEmulator
    from fedge.simulations.verifier_process import VerifierProcess
    from fedge.zoo import ensure_zoo

    load_start = Path("/proc/loadavg").read_text().split()[:3]
    if args.target is None:
        zoo = ensure_zoo(args.preset)
        target_dir, draft_dir = zoo.target_dir, zoo.draft_dir
    else:  # no draft needed: the cloud-only route never calls it
        target_dir = draft_dir = args.target
    model = load_causal_lm(target_dir)
    prompts = [p[:16] for p in heldout_prompts(load_tokenizer(target_dir), args.prompts, 16)]
    n = args.tokens * len(prompts)

    def hf(prompt: list[int]) -> list[int]:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            do_sample=False,
        )
        return [int(t) for t in out[0, len(prompt) :]]

    hf(prompts[0])  # warm up
    expected = [hf(p) for p in prompts]

    def timed(
        run: Callable[[list[int]], list[int]], pid: int | None
    ) -> tuple[float, float, list[list[int]]]:
        """Seconds and CPU seconds (of `pid`, else this process) for every prompt, and the tokens."""
        cpu = (lambda: cpu_seconds(pid)) if pid is not None else own_cpu_seconds
        cpu0, started = cpu(), time.perf_counter()
        produced = [run(p) for p in prompts]
        return time.perf_counter() - started, cpu() - cpu0, produced

    arms: dict[str, list[tuple[float, float]]] = {"hf": [], "generate": [], "edge_cloud_only": []}
    identical = True
    server = VerifierProcess(target_dir, torch_threads=args.threads)
    draft = load_draft_runtime(draft_dir, "torch", threads=args.threads)
    decode = DecodeConfig(max_new_tokens=args.tokens)
    try:
        with (
            VerifierClient(ClientConfig(f"127.0.0.1:{server.port}")) as direct,
            NetworkEmulator(server.port) as netem,
            VerifierClient(ClientConfig(f"127.0.0.1:{netem.port}")) as proxied,
        ):
            edge = EdgeClient(draft, None, proxied, decode, Router())

            def generate(prompt: list[int]) -> list[int]:
                return list(direct.generate(prompt, args.tokens))

            def cloud_only(prompt: list[int]) -> list[int]:
                return [t for chunk in edge.stream_ids(prompt, "cloud-only") for t in chunk]

            generate(prompts[0])  # warm up: connected, first pass compiled
            cloud_only(prompts[-1])
            for _ in range(args.rounds):  # interleaved: drift weighs on every arm alike
                for name, run, pid in (
                    ("hf", hf, None),
                    ("generate", generate, server.proc.pid),
                    ("edge_cloud_only", cloud_only, server.proc.pid),
                ):
                    seconds, cpu, produced = timed(run, pid)
                    arms[name].append((seconds, cpu))
                    identical &= produced == expected
    finally:
        server.stop()
    config = ServerConfig(target_dir, drain_notice_s=0.0)
    with (
        BackgroundServer(config, model) as background,
        VerifierClient(ClientConfig(f"127.0.0.1:{background.port}")) as local,
    ):
        list(local.generate(prompts[0], args.tokens))  # warm up
        in_process_s, _, produced = timed(lambda p: list(local.generate(p, args.tokens)), None)
        identical &= produced == expected

    def tok_s(name: str) -> float:
        return n / statistics.median(s for s, _ in arms[name])

    def cpu_ms(name: str) -> float:
        return statistics.median(c for _, c in arms[name]) / n * 1e3

    hf_tok_s = tok_s("hf")
    result = {
        "preset": args.preset if args.target is None else None,
        "target": str(target_dir),
        "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "tokens": n,
        "rounds": args.rounds,
        "hf_greedy_tok_s": round(hf_tok_s, 1),
        "generate_tok_s": round(tok_s("generate"), 1),
        "ratio": round(tok_s("generate") / hf_tok_s, 3),
        "edge_cloud_only_tok_s": round(tok_s("edge_cloud_only"), 1),
        "edge_cloud_only_ratio": round(tok_s("edge_cloud_only") / hf_tok_s, 3),
        "goal": 1.0,
        "identical": identical,
        "torch_threads": args.threads,
        "cpu_ms_per_token": {
            "hf_greedy_bench_process": round(cpu_ms("hf"), 3),
            "verifier_generate": round(cpu_ms("generate"), 3),
            "verifier_edge_cloud_only": round(cpu_ms("edge_cloud_only"), 3),
        },
        # plain decoding's CPU per token over the verifier's: steadier than the tokens/s ratio on a
        # shared machine (waiting for a core costs no CPU); the client's own CPU is not counted
        "cpu_ratio": round(cpu_ms("hf") / cpu_ms("generate"), 3),
        "edge_cloud_only_cpu_ratio": round(cpu_ms("hf") / cpu_ms("edge_cloud_only"), 3),
        "per_round_tok_s": {k: [round(n / s, 1) for s, _ in v] for k, v in arms.items()},
        "in_process_generate_tok_s": round(n / in_process_s, 1),
        "in_process_ratio": round(n / in_process_s / hf_tok_s, 3),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
    }
    out = Path(args.results) if os.sep in args.results else RESULTS.with_name(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
