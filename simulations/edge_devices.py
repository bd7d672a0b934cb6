"""Emulated edge devices for capacity and fault runs: replayed drafts, real clients, real verifier.

Devices are other machines in reality; here dozens of them must share two cores with the
verifier, so none runs its draft model. Beforehand, `ReplayTable.record` runs the real draft
along the target's greedy path and stores, for every position of that path, the draft's own
greedy continuation up to `depth` tokens ahead. `ReplayRuntime` then answers the speculative
decoder exactly as the draft would (greedy) by looking the prefix up, and sleeps the draft's
measured step time per call, so each device costs the verifier what a real one costs and its
own machine almost nothing. Everything else is real: `EdgeClient`, `SpeculativeDecoder`, the
router, gRPC through the network emulator, and the verifier process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fedge.edge.runtime import DraftRuntime


@dataclass(frozen=True)
class ReplayTable:
    """The target's greedy path after a prompt and the draft's continuation at every position."""

    prompt_len: int
    path: tuple[int, ...]  # prompt + the target's greedy continuation
    continuations: tuple[tuple[int, ...], ...]  # [p - prompt_len] = draft greedy after path[:p]
    vocab_size: int
    max_context: int

    @classmethod
    def record(
        cls, runtime: DraftRuntime, prompt: Sequence[int], target_tokens: Sequence[int], depth: int
    ) -> ReplayTable:
        """Run the real draft along `prompt + target_tokens`, `depth` greedy tokens at each step."""
        if depth < 1:
            raise ValueError(f"ReplayTable.record: depth must be >= 1, got {depth}")
        path = [*prompt, *target_tokens]
        runtime.reset()
        logits = runtime.extend(list(prompt))
        continuations = []
        for p in range(len(prompt), len(path) + 1):
            own = [int(np.argmax(logits))]
            step = logits
            for _ in range(depth - 1):
                step = runtime.extend([own[-1]])
                own.append(int(np.argmax(step)))
            continuations.append(tuple(own))
            runtime.truncate(p)
            if p < len(path):
                logits = runtime.extend([path[p]])
        return cls(
            len(prompt), tuple(path), tuple(continuations), runtime.vocab_size, runtime.max_context
        )

    def next_token(self, sequence: Sequence[int]) -> int:
        """The draft's greedy token after `sequence` (a path prefix plus the draft's own tokens)."""
        common = 0
        for have, want in zip(sequence, self.path, strict=False):
            if have != want:
                break
            common += 1
        if common < self.prompt_len:
            raise ValueError("ReplayTable: the sequence does not start with the recorded prompt")
        own = self.continuations[min(common, len(self.path)) - self.prompt_len]
        return own[min(len(sequence) - common, len(own) - 1)]  # past the table: repeat its last


class ReplayRuntime:
    """A `DraftRuntime` that replays a recorded draft and waits its step time per call."""

    name = "replay"

    def __init__(
        self, table: ReplayTable, step_s: float, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.table = table
        self.step_s = step_s
        self.vocab_size = table.vocab_size
        self.max_context = table.max_context
        self._sleep = sleep
        self._sequence: list[int] = []

    @property
    def length(self) -> int:
        """Tokens held."""
        return len(self._sequence)

    def extend(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append tokens, wait one draft step, and return logits whose argmax is the draft's token."""
        if not token_ids:
            raise ValueError("extend needs at least one token id")
        self._sequence.extend(int(t) for t in token_ids)
        self._sleep(self.step_s)
        logits = np.full(self.vocab_size, -1e4, dtype=np.float32)
        logits[self.table.next_token(self._sequence)] = 0.0
        return logits

    def truncate(self, length: int) -> None:
        """Forget every token past `length`."""
        del self._sequence[length:]

    def reset(self) -> None:
        """Forget every token."""
        self._sequence.clear()


@dataclass(frozen=True)
class RequestFigures:
    """One request as a device saw it."""

    device: int
    route: str
    reason: str
    tokens: int
    seconds: float
    ttft_s: float
    round_trips: int
    error: str | None = None


def run_devices(
    count: int,
    run_request: Callable[[int, int], RequestFigures],
    requests: int,
    warmup: int = 1,
) -> list[RequestFigures]:
    """`count` devices in threads, started together, each making `warmup` + `requests` requests
    (`run_request(device, index)`); returns the measured (non-warm-up) requests."""
    barrier = threading.Barrier(count)
    results: list[list[RequestFigures]] = [[] for _ in range(count)]

    def device(i: int) -> None:
        barrier.wait()
        for r in range(warmup + requests):
            figures = run_request(i, r)
            if r >= warmup:
                results[i].append(figures)

    threads = [threading.Thread(target=device, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [f for per_device in results for f in per_device]


def devices_meeting(
    figures: list[RequestFigures], tokens_per_s: float, ttft_s: float
) -> tuple[int, int]:
    """(devices meeting the objective, devices): a device meets it when its requests together
    ran at >= tokens_per_s, none started later than ttft_s, and none failed."""
    by_device: dict[int, list[RequestFigures]] = {}
    for f in figures:
        by_device.setdefault(f.device, []).append(f)
    met = 0
    for runs in by_device.values():
        seconds = sum(f.seconds for f in runs)
        rate = sum(f.tokens for f in runs) / seconds if seconds else 0.0
        if rate >= tokens_per_s and max(f.ttft_s for f in runs) <= ttft_s:
            met += all(f.error is None for f in runs)
    return met, len(by_device)


def max_devices(
    trial: Callable[[int], bool], limit: int, refine: int = 2
) -> tuple[int, dict[int, bool]]:
    """The largest device count for which `trial(n)` holds: doubling from 1 up to `limit`, then
    `refine` bisection steps between the last pass and the first failure."""
    seen: dict[int, bool] = {}
    n, best, failed = 1, 0, None
    while n <= limit:
        seen[n] = trial(n)
        if not seen[n]:
            failed = n
            break
        best, n = n, n * 2
    if failed is None:
        return best, seen
    lo, hi = best, failed
    for _ in range(refine):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        seen[mid] = trial(mid)
        lo, hi = (mid, hi) if seen[mid] else (lo, mid)
    return lo, seen
