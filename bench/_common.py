"""Helpers the benches share (one home, so no bench imports another bench's script)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def loadavg() -> str:
    """The 1/5/15-minute load average, recorded next to every figure."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rounded(value: Any) -> Any:
    """Floats to 4 significant digits, recursively, for a readable JSON result."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def write_result(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write the bench's JSON result to ``path`` and print it as the last line of output."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result)
    path.write_text(text + "\n")
    print(text)
    return result


def config_value(text: str) -> Any:
    """A ``--set key=value`` value as TOML reads it (number, bool, or string when neither)."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def plain_ort_same_graph(
    model: Any, prompts: list[list[int]], n: int, threads: int
) -> list[tuple[list[int], float, float]]:
    """Plain greedy decoding on the verifier's own ONNX graph and session options (`OrtRuntime`
    driven directly: no service, no network), `n` tokens after each prompt: per prompt its
    tokens, prefill seconds and per-token decode seconds. The verifier's runtime, so the
    baseline of a cloud-only or speculative figure."""
    import torch

    from fedge.edge.verifier.ort import OrtRuntime, target_export

    runtime = OrtRuntime(target_export(model), threads)
    out = []
    with torch.inference_mode():
        runtime.prefill(prompts[0][:4])  # warm-up
        for prompt in prompts:
            started = time.perf_counter()
            cache, logits = runtime.prefill(prompt, want_logits=True)
            assert logits is not None
            tokens = [int(logits[0, -1].argmax())]
            first = time.perf_counter()
            while len(tokens) < n:
                logits = runtime.forward_on(torch.tensor([tokens[-1:]]), cache)
                tokens.append(int(logits[0, -1].argmax()))
            last = time.perf_counter()
            out.append((tokens, first - started, (last - first) / max(1, n - 1)))
    return out


def alternating_verifies(
    clients: dict[str, Any], draft: list[int], prompt: list[int], verifies: int
) -> dict[str, list[float]]:
    """Seconds of each verify round trip, one session per client, the clients' calls
    alternating so that machine noise hits every configuration alike."""
    sessions = {name: client.open(prompt).session_id for name, client in clients.items()}
    seconds: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(verifies):
        for name, client in clients.items():
            started = time.perf_counter()
            client.verify(sessions[name], draft)
            seconds[name].append(time.perf_counter() - started)
    for name, client in clients.items():
        client.close(sessions[name])
    return seconds


def alternating_args(description: str) -> argparse.Namespace:
    """`--rounds` (default 8) of `--verifies` (default 40) alternating verifies per configuration."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--verifies", type=int, default=40)
    return parser.parse_args()


def percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """p50 and p99 in ms of each configuration's round trips (given in seconds)."""
    import numpy as np

    return {
        name: {
            "p50_ms": float(np.percentile(values, 50)) * 1e3,
            "p99_ms": float(np.percentile(values, 99)) * 1e3,
        }
        for name, values in samples.items()
    }


def block_order(arms: tuple[str, ...], blocks: int) -> list[tuple[int, str]]:
    """(block, arm) in ABBA order: each pair of blocks runs the arms forwards then back, so a
    machine that drifts steadily faster or slower over a run weighs on every arm alike."""
    return [
        (block, arm) for block in range(blocks) for arm in (arms if block % 2 == 0 else arms[::-1])
    ]
