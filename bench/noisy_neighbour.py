"""Noisy neighbour: what one device holding all its credential allows costs 8 ordinary devices.

A verifier runs as deployed (`fedge verifier serve` in its own process, per-device credentials,
no fairness option set). 8 ordinary devices each stream Generate calls back to back from this
process and record the gap between consecutive tokens (inter-token latency, ITL): for
`--seconds` alone, then for `--seconds` beside a noisy device (a process of its own), the pair
`--rounds` times, alternated so that drift in the machine's load hits both. The noisy device
keeps as many Generate streams open as its credential allows (`--noisy-streams` threads, each
retrying as soon as a refusal's retry-after allows, 20 ms without one) and opens idle sessions
nonstop. Reported: the ordinary devices' p99 ITL with and without the noisy device and their
ratio (goal <= 1.2), the ordinary devices' refusals (goal none), and what the noisy device got
(tokens, sessions, outcomes by code). Prints one JSON object on the last line and writes
bench/results/noisy_neighbour.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import secrets
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

RESULTS = Path(__file__).resolve().parent / "results" / "noisy_neighbour.json"
PROMPT = 16  # tokens of every Generate prompt


def _stub(port: int) -> Any:
    import grpc

    from fedge.edge.proto import verifier_pb2_grpc as pb_grpc

    return pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def _prompt(seed: int) -> list[int]:
    return [2 + (seed * 31 + i * 7) % 900 for i in range(PROMPT)]


def ordinary(
    port: int, token: str, index: int, tokens: int, stop: threading.Event, out: dict[str, Any]
) -> None:
    """Stream Generates until `stop`; collect inter-token gaps (s) and refusals by code."""
    import grpc

    from fedge.edge.proto import verifier_pb2 as pb

    stub, auth = _stub(port), (("authorization", f"Bearer {token}"),)
    gaps: list[float] = out.setdefault("gaps", [])
    errors: Counter[str] = out.setdefault("errors", Counter())
    calls = 0
    while not stop.is_set():
        request = pb.GenerateRequest(
            prompt_ids=_prompt(index * 1000 + calls), max_new_tokens=tokens
        )
        calls += 1
        last = None
        try:
            for _ in stub.Generate(request, metadata=auth):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
        except grpc.RpcError as error:
            errors[error.code().name] += 1  # type: ignore[attr-defined]
    out["calls"] = out.get("calls", 0) + calls


def _backoff(error: Any) -> float:
    """Seconds until the credential allows the call again: the server's retry-after, else 20 ms
    (a refusal without one: quota or fair share); the noisy device retries right then."""
    from fedge.edge.verifier.limits import retry_after_ms

    wait_ms = retry_after_ms(error.trailing_metadata())
    return max(0.02, (wait_ms or 0) / 1e3)


def noisy(port: int, token: str, streams: int, tokens: int, seconds: float, queue: Any) -> None:
    """The noisy device (own process): `streams` Generate loops and an opener, for `seconds`."""
    import grpc

    from fedge.edge.proto import verifier_pb2 as pb

    stub, auth = _stub(port), (("authorization", f"Bearer {token}"),)
    stop = threading.Event()
    codes: Counter[str] = Counter()
    produced = [0]
    held: list[str] = []
    lock = threading.Lock()

    def stream(index: int) -> None:
        calls = 0
        while not stop.is_set():
            calls += 1
            request = pb.GenerateRequest(
                prompt_ids=_prompt(50_000 + index * 1000 + calls), max_new_tokens=tokens
            )
            try:
                count = sum(1 for _ in stub.Generate(request, metadata=auth))
                with lock:
                    produced[0] += count
                    codes["OK"] += 1
            except grpc.RpcError as error:
                with lock:
                    codes[error.code().name] += 1  # type: ignore[attr-defined]
                time.sleep(_backoff(error))

    def opener() -> None:
        calls = 0
        while not stop.is_set():
            calls += 1
            request = pb.OpenSessionRequest(prompt_ids=_prompt(90_000 + calls) * 4)
            try:
                held.append(stub.OpenSession(request, metadata=auth).session_id)
                with lock:
                    codes["open OK"] += 1
            except grpc.RpcError as error:
                with lock:
                    codes["open " + error.code().name] += 1  # type: ignore[attr-defined]
                time.sleep(_backoff(error))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    threads.append(threading.Thread(target=opener, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    queue.put({"tokens": produced[0], "opened": len(held), "outcomes": dict(codes)})


def phase(
    port: int, tokens: dict[str, str], devices: int, stream_tokens: int, seconds: float
) -> dict[str, Any]:
    """The ordinary devices stream for `seconds`; their p50/p99 ITL (ms) and refusals."""
    stop = threading.Event()
    outs: list[dict[str, Any]] = [{} for _ in range(devices)]
    threads = [
        threading.Thread(
            target=ordinary,
            args=(port, tokens[f"device-{i}"], i, stream_tokens, stop, outs[i]),
            daemon=True,
        )
        for i in range(devices)
    ]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    gaps = sorted(g for out in outs for g in out.get("gaps", []))
    errors: Counter[str] = Counter()
    for out in outs:
        errors.update(out.get("errors", {}))

    def quantile(q: float) -> float:
        return 1e3 * gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else float("nan")

    return {
        "tokens": len(gaps) + sum(out.get("calls", 0) for out in outs),
        "itl_p50_ms": quantile(0.50),
        "itl_p99_ms": quantile(0.99),
        "refusals": dict(errors),
        "gaps": gaps,
    }


def pooled(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The phases of one kind together: p50/p99 ITL over all their gaps, summed refusals."""
    gaps = sorted(g for p in phases for g in p.pop("gaps"))
    errors: Counter[str] = Counter()
    for p in phases:
        errors.update(p["refusals"])

    def quantile(q: float) -> float:
        return 1e3 * gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else float("nan")

    return {
        "tokens": sum(p["tokens"] for p in phases),
        "itl_p50_ms": quantile(0.50),
        "itl_p99_ms": quantile(0.99),
        "refusals": dict(errors),
        "rounds": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="micro", help="zoo preset (micro, demo, default)")
    parser.add_argument("--devices", type=int, default=8, help="ordinary devices")
    parser.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    parser.add_argument("--tokens", type=int, default=64, help="max_new_tokens per Generate")
    parser.add_argument(
        "--noisy-streams", type=int, default=32, help="noisy Generate loops (twice its quota)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alone/beside phase pairs")
    parser.add_argument("--threads", type=int, default=1, help="the verifier's torch threads")
    args = parser.parse_args()

    from fedge.simulations.verifier_process import VerifierProcess
    from fedge.zoo import ensure_zoo

    zoo = ensure_zoo(args.preset)
    names = [f"device-{i}" for i in range(args.devices)] + ["noisy"]
    tokens = {name: secrets.token_hex(16) for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        credentials = Path(tmp) / "credentials"
        credentials.write_text("".join(f"{n} {t}\n" for n, t in tokens.items()))
        server = VerifierProcess(
            zoo.target_dir,
            torch_threads=args.threads,
            extra_args=("--credentials", str(credentials)),
        )
        try:
            phase(server.port, tokens, args.devices, args.tokens, 2.0)["gaps"].clear()  # warm up
            alones, besides, noisy_results = [], [], []
            context = multiprocessing.get_context("spawn")
            for _ in range(args.rounds):  # alternated, so drift in the machine's load hits both
                alones.append(phase(server.port, tokens, args.devices, args.tokens, args.seconds))
                queue = context.Queue()
                warmup = 3.0
                neighbour = context.Process(
                    target=noisy,
                    args=(
                        server.port,
                        tokens["noisy"],
                        args.noisy_streams,
                        args.tokens,
                        args.seconds + warmup,
                        queue,
                    ),
                )
                neighbour.start()
                time.sleep(warmup)  # the noisy device holds what it can before the measurement
                besides.append(phase(server.port, tokens, args.devices, args.tokens, args.seconds))
                noisy_results.append(queue.get(timeout=120))
                neighbour.join(timeout=60)
        finally:
            server.stop()
    alone, beside = pooled(alones), pooled(besides)
    ratio = beside["itl_p99_ms"] / alone["itl_p99_ms"]
    result = {
        "preset": args.preset,
        "ordinary_devices": args.devices,
        "seconds_per_phase": args.seconds,
        "rounds": args.rounds,
        "max_new_tokens": args.tokens,
        "noisy_stream_loops": args.noisy_streams,
        "torch_threads": args.threads,
        "alone": alone,
        "beside_noisy": beside,
        "p99_itl_ratio": ratio,
        "goal_ratio": 1.2,
        "ordinary_refusals": sum(beside["refusals"].values()) + sum(alone["refusals"].values()),
        "goal_refusals": 0,
        "noisy": noisy_results,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
