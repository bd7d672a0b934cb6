"""Benchmark the verifier's target runtimes: cloud-only Generate per token on torch and ONNX Runtime.

In one run, on one model (default: the converted SmolLM2-135M under FEDGE_HOME):

1. Plain greedy decoding, no service: HF torch (`model.generate`); ONNX Runtime on the
   draft-style export (`fedge.edge.export.export_onnx`, no mask inputs: the leanest graph),
   feeding the presents back as the next pasts (`OnnxDraftRuntime`, ORT's default threads,
   which spin); and ONNX Runtime on the verifier's own graph and options (`OrtRuntime` driven
   directly). The ratios are to the faster of the two ORT figures.
2. Cloud-only Generate through a real verifier on 127.0.0.1 (gRPC, the engine's worker, the
   token channel), with `--runtime torch` and with `--runtime onnx`, one stream at a time.
3. The ONNX runtime's padded batch against one pass per session, for sessions of different
   lengths (the choice `OrtRuntime.batched_forward` makes).

Per token is decode only: the time from the first token to the last over the tokens between
(the prefill is reported apart). Every run's tokens are compared with plain ORT greedy's.
The goal (issue 34): the ONNX verifier's per-token time within 1.2x of plain ORT greedy's.

Usage: ``python bench/verifier_runtime.py [--quick] [--model DIR] [--tokens N]``; the last line
printed is one JSON object, also written to ``bench/results/verifier_runtime.json``
(``verifier_runtime_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from bench._common import plain_ort_same_graph, rounded
from fedge.paths import fedge_home

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n'


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def plain_export(model: Any, digest: str) -> tuple[Path, dict[str, Any]]:
    """The draft-style export of `model` (no mask inputs), cached beside the verifier's."""
    from fedge.edge.export import _geometry, export_onnx

    folder = fedge_home() / "verifier" / "onnx" / f"{digest[:32]}-plain"
    path = folder / "plain.onnx"
    geometry = _geometry(model)
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        scratch = folder / "plain.onnx.tmp"
        export_onnx(model, scratch)
        scratch.rename(path)
    past_names = [f"past_{k}_{i}" for i in range(geometry["num_layers"]) for k in ("key", "value")]
    return path, {**geometry, "past_names": past_names}


def plain_ort(path: Path, manifest: dict[str, Any], prompt: list[int], n: int, threads: int):
    """Plain ORT greedy decoding: tokens, prefill seconds, per-token decode seconds."""
    import numpy as np

    from fedge.edge.runtime import OnnxDraftRuntime

    runtime = OnnxDraftRuntime(path, manifest, name="plain-ort", threads=threads)
    runtime.extend(prompt[:4])  # warm-up
    runtime.reset()
    started = time.perf_counter()
    logits = runtime.extend(prompt)
    tokens = [int(np.argmax(logits))]
    first = time.perf_counter()
    while len(tokens) < n:
        tokens.append(int(np.argmax(runtime.extend(tokens[-1:]))))
    last = time.perf_counter()
    return tokens, first - started, (last - first) / (n - 1)


def plain_torch(model: Any, prompt: list[int], n: int) -> tuple[list[int], float]:
    """HF greedy decoding: tokens and seconds per token (prefill included: generate hides it)."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # warm-up
    started = time.perf_counter()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, len(prompt) :].tolist(), (time.perf_counter() - started) / n


def through_verifier(
    model_dir: Path, model: Any, runtime: str, prompt: list[int], n: int, threads: int
) -> dict[str, Any]:
    """Cloud-only Generate over gRPC on 127.0.0.1 with the verifier on `runtime`."""
    from fedge.edge.client import ClientConfig, VerifierClient
    from fedge.edge.verifier.engine import EngineConfig
    from fedge.edge.verifier.server import BackgroundServer, ServerConfig

    engine = EngineConfig(runtime=runtime, torch_threads=threads, batch_window_s=0.0)
    config = ServerConfig(model_dir, drain_notice_s=0.0, engine=engine)
    started = time.perf_counter()
    with BackgroundServer(config, model) as server:
        ready = time.perf_counter() - started
        assert server.server is not None and server.server.engine is not None
        served = type(server.server.engine.runtime).__name__
        with VerifierClient(ClientConfig(f"127.0.0.1:{server.port}")) as client:
            list(client.generate(prompt, 2))  # warm-up
            stamps: list[float] = []
            tokens: list[int] = []
            started = time.perf_counter()
            for token in client.generate(prompt, n):
                tokens.append(token)
                stamps.append(time.perf_counter())
    return {
        "runtime": served,
        "ready_s": ready,
        "tokens": tokens,
        "first_token_s": stamps[0] - started,
        "per_token_s": (stamps[-1] - stamps[0]) / (n - 1),
    }


def batching(model: Any, threads: int, sessions: int = 4) -> dict[str, float]:
    """One padded decode step of `sessions` sessions of different lengths against one pass each."""
    from fedge.edge.verifier.ort import OrtRuntime, target_export

    runtime = OrtRuntime(target_export(model), threads)
    caches = [runtime.prefill([3 + i for i in range(16 + 24 * s)])[0] for s in range(sessions)]
    inputs = [[5] for _ in caches]

    def median(call: Any, repeats: int = 5) -> float:
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            call()
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)

    def one_by_one() -> None:
        for cache in caches:
            saved = cache.arrays
            runtime.forward_on(torch.tensor(inputs[0:1]), cache)
            cache.arrays = saved

    padded = median(lambda: runtime.batched_forward(caches, inputs))
    separate = median(one_by_one)
    return {"sessions": sessions, "padded_s": padded, "one_pass_each_s": separate}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=fedge_home() / "models" / "smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    parser.add_argument("--quick", action="store_true", help="16 tokens, 1 run (a smoke size)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 16, 1
    from fedge.edge.verifier.ort import target_export, weights_digest
    from fedge.models import load_causal_lm, load_tokenizer

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    result: dict[str, Any] = {"model": str(args.model), "threads": threads, "load_start": loadavg()}
    wall = time.perf_counter()
    model = load_causal_lm(args.model).eval()
    prompt = load_tokenizer(args.model)(PROMPT)["input_ids"]
    result |= {"prompt_tokens": len(prompt), "new_tokens": args.tokens}
    began = time.perf_counter()
    digest = weights_digest(model)
    result["digest_s"] = time.perf_counter() - began
    began = time.perf_counter()
    target_export(model)
    result["verifier_export_s"] = time.perf_counter() - began  # ~0 when cached
    path, manifest = plain_export(model, digest)
    runs: dict[str, list[dict[str, Any]]] = {
        "plain_torch": [],
        "plain_ort": [],
        "plain_ort_same_graph": [],
        "verifier_torch": [],
        "verifier_onnx": [],
    }
    for _ in range(args.repeats):
        with torch.inference_mode():
            tokens, per = plain_torch(model, prompt, args.tokens)
        runs["plain_torch"].append({"tokens": tokens, "per_token_s": per})
        tokens, prefill, per = plain_ort(path, manifest, prompt, args.tokens, threads)
        runs["plain_ort"].append({"tokens": tokens, "prefill_s": prefill, "per_token_s": per})
        with torch.inference_mode():
            [(tokens, prefill, per)] = plain_ort_same_graph(model, [prompt], args.tokens, threads)
        runs["plain_ort_same_graph"].append(
            {"tokens": tokens, "prefill_s": prefill, "per_token_s": per}
        )
        for runtime in ("torch", "onnx"):
            runs[f"verifier_{runtime}"].append(
                through_verifier(args.model, model, runtime, prompt, args.tokens, threads)
            )
        result["load_during"] = loadavg()
    reference = runs["plain_ort"][0]["tokens"]
    for name, samples in runs.items():
        result[name] = {
            "per_token_ms": 1e3 * statistics.median(s["per_token_s"] for s in samples),
            "samples_ms": [round(1e3 * s["per_token_s"], 2) for s in samples],
            "identical_to_plain_ort": all(s["tokens"] == reference for s in samples),
            **{k: v for k, v in samples[-1].items() if k not in ("tokens", "per_token_s")},
        }
    # the baseline is the faster plain ORT decoding: its own graph with ORT's default (spinning)
    # threads, or the verifier's graph and passive threads
    plain = min(result[n]["per_token_ms"] for n in ("plain_ort", "plain_ort_same_graph"))
    result["plain_ort_best_ms"] = plain
    for name in ("verifier_torch", "verifier_onnx", "plain_torch"):
        result[name]["ratio_to_plain_ort"] = result[name]["per_token_ms"] / plain
    result["goal_onnx_verifier_within_1_2x"] = result["verifier_onnx"]["ratio_to_plain_ort"] <= 1.2
    with torch.inference_mode():
        result["batching"] = batching(model, threads)
    result["tokens"] = reference
    result["load_end"] = loadavg()
    result["wall_s"] = time.perf_counter() - wall
    line = json.dumps(rounded(result))
    out = RESULTS / ("verifier_runtime_quick.json" if args.quick else "verifier_runtime.json")
    out.write_text(json.dumps(rounded(result), indent=2) + "\n")
    print(line)


if __name__ == "__main__":
    main()
