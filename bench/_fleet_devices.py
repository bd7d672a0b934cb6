"""Emulated edge devices of the fleet bench: one process each, so their load reaches the replicas.

Threads of one process share its interpreter lock and cores with their drafts, so 12
of them never kept the replicas' queues full; as processes they do. A pool is started
once (each process loads the draft model once) and driven run after run: every device
decodes requests back to back against the given endpoint until the pool's stop event,
then returns its records.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPAWN = mp.get_context("spawn")  # no fork: grpc and Ray in the parent are not fork-safe


@dataclass(frozen=True)
class Endpoint:
    """Where the devices connect: the port, and for a secure fleet the CA and each one's token."""

    port: int
    root_cert: Path | None = None
    tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class Load:
    """What each device asks for."""

    new_tokens: int
    long_share: float
    speculative_share: float


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


def _speculative(client: Any, draft: Any, prompt: list[int], n: int) -> tuple[list[float], int]:
    """Greedy speculative decoding; a lost session (NOT_FOUND) reopens from the committed tokens.

    Returns the arrival time of each token and how often the session was reopened.
    """
    import grpc

    from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
    from fedge.edge.runtime import TorchDraftRuntime

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


def _requests(
    index: int,
    endpoint: Endpoint,
    draft: Any,
    prompts: dict[str, list[list[int]]],
    load: Load,
    seed: int,
    stop: Any,
) -> list[dict[str, Any]]:
    """One device's requests, back to back until `stop` is set."""
    from fedge.edge.client import ClientConfig, VerifierClient

    rng = random.Random(seed)
    records: list[Record] = []
    config = ClientConfig(
        f"127.0.0.1:{endpoint.port}",
        token=endpoint.tokens[index] if endpoint.tokens else None,
        root_cert=endpoint.root_cert,
        tls_server_name="localhost" if endpoint.root_cert else None,
        timeout_s=120,
        device_id=f"device-{index}",
    )
    with VerifierClient(config) as client:
        while not stop.is_set():
            prompt = rng.choice(prompts["long" if rng.random() < load.long_share else "short"])
            route = "speculative" if rng.random() < load.speculative_share else "cloud-only"
            started = time.perf_counter()
            try:
                if route == "speculative":
                    arrivals, reopened = _speculative(client, draft, prompt, load.new_tokens)
                else:
                    arrivals = [
                        time.perf_counter() for _ in client.generate(prompt, load.new_tokens)
                    ]
                    reopened = 0
            except Exception as err:  # a failed request is a result of this bench
                elapsed = time.perf_counter() - started
                records.append(Record(route, 0, 0.0, elapsed, False, 0, repr(err)))
                continue
            ttft, e2e = arrivals[0] - started, arrivals[-1] - started
            records.append(Record(route, len(arrivals), ttft, e2e, True, reopened))
    return [asdict(r) for r in records]


def _device(
    index: int,
    draft_dir: Path,
    prompts: dict[str, list[list[int]]],
    load: Load,
    tasks: Any,
    results: Any,
    stop: Any,
) -> None:
    """A device process: load the draft once, then serve runs from `tasks` until None."""
    import torch

    from fedge.models import load_causal_lm

    torch.set_num_threads(1)
    draft = load_causal_lm(draft_dir)
    results.put((index, "ready", []))
    while (task := tasks.get()) is not None:
        endpoint, seed = task
        try:
            results.put(
                (index, "done", _requests(index, endpoint, draft, prompts, load, seed, stop))
            )
        except Exception as err:  # the device could not even connect: report, keep the pool
            failed = Record("connect", 0, 0.0, 0.0, False, 0, repr(err))
            results.put((index, "done", [asdict(failed)]))


class DevicePool:
    """`count` device processes, started once, driven run after run (`run`)."""

    def __init__(
        self, count: int, draft_dir: Path, prompts: dict[str, list[list[int]]], load: Load
    ) -> None:
        self.stop = SPAWN.Event()
        self._results: Any = SPAWN.Queue()
        self._tasks = [SPAWN.Queue() for _ in range(count)]
        self._processes = [
            SPAWN.Process(
                target=_device,
                args=(i, draft_dir, prompts, load, self._tasks[i], self._results, self.stop),
                daemon=True,
            )
            for i in range(count)
        ]
        for process in self._processes:
            process.start()
        for _ in range(count):
            self._collect(timeout_s=300)

    def _collect(self, timeout_s: float) -> tuple[int, str, list[dict[str, Any]]]:
        try:
            return self._results.get(timeout=timeout_s)  # type: ignore[no-any-return]
        except queue.Empty:
            raise RuntimeError(f"a device process gave no answer in {timeout_s:.0f} s") from None

    def run(
        self, endpoint: Endpoint, duration_s: float, seed: int, event: Any = None
    ) -> tuple[list[Record], float]:
        """Every device loads `endpoint` for `duration_s`; `event()` runs a third of the way in
        (when it takes long, as a restart does, the load runs on at least a third after it)."""
        self.stop.clear()
        started = time.perf_counter()
        for i, tasks in enumerate(self._tasks):
            tasks.put((endpoint, seed * 1000 + i))
        if event is not None:
            time.sleep(duration_s / 3)
            hooked = time.perf_counter()
            event()
            spent = time.perf_counter() - hooked
            time.sleep(max(duration_s * 2 / 3 - spent, duration_s / 3))
        else:
            time.sleep(duration_s)
        self.stop.set()
        records: list[Record] = []
        for _ in self._tasks:
            _, _, rows = self._collect(timeout_s=300)
            records += [Record(**row) for row in rows]
        return records, time.perf_counter() - started

    def close(self) -> None:
        """Stop the device processes (each by its own handle)."""
        for tasks in self._tasks:
            tasks.put(None)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
