"""What the fleet tests share: greedy references, an edge decode that reopens, background load, waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.runtime import TorchDraftRuntime

NEW_TOKENS = 16


def greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy continuation."""
    out = model.generate(  # type: ignore[operator]
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def decode_with_reopen(
    client: VerifierClient, draft: PreTrainedModel, prompt: list[int], n: int
) -> tuple[list[int], int]:
    """Speculative decoding that reopens a lost session (NOT_FOUND) from its committed tokens.

    Returns the tokens and how many times the session was reopened.
    """
    committed: list[int] = []
    reopened = 0
    while len(committed) < n:
        decoder = SpeculativeDecoder(
            TorchDraftRuntime(draft), client, DecodeConfig(max_new_tokens=n - len(committed))
        )
        try:
            for chunk in decoder.stream(prompt + committed):
                committed += chunk
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise
            reopened += 1
    return committed[:n], reopened


def patient_config(port: int) -> ClientConfig:
    """The edge's client config with the suite's patience: UNAVAILABLE retried for 30 s, not
    the edge's 3 s, and a health check waited as long, not the edge's 1 s.

    On a machine shared with the rest of the suite (load 40 seen) a replica swap or the
    ingress's answer can take longer, and the device would answer alone: a rolling restart's
    cloud-only request once came back from the draft with 0 bytes sent, routed to the device
    from the start (a failed health check; a 1 s deadline under load 20 and more).
    """
    return ClientConfig(
        f"127.0.0.1:{port}", timeout_s=60, unreachable_after_s=30.0, health_timeout_s=30.0
    )


class Load:
    """Edge sessions decoding in background threads until stopped; records every failure."""

    def __init__(
        self,
        port: int,
        work: Callable[[VerifierClient, int], None],
        threads: int,
        pause_s: float = 0.0,
    ):
        """`threads` devices, each running `work` again `pause_s` after it returns: a test
        needs calls in flight across an event (a kill, a restart), not two cores saturated by
        the load; a test that needs a queue (autoscaling) leaves no pause."""
        self.stop = threading.Event()
        self.pause_s = pause_s
        self.failures: list[str] = []
        self.done = 0
        self._threads = [
            threading.Thread(target=self._loop, args=(port, work, i), daemon=True)
            for i in range(threads)
        ]

    def _loop(self, port: int, work: Callable[[VerifierClient, int], None], index: int) -> None:
        config = patient_config(port)
        with VerifierClient(config) as client:
            while not self.stop.is_set():
                try:
                    work(client, index)
                    self.done += 1
                except Exception as err:  # every failure is a finding of the test
                    self.failures.append(repr(err))
                self.stop.wait(self.pause_s)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def replaced(now: dict[str, str], before: dict[str, str], victim: str) -> bool:
    """Two replicas again, the victim gone and a new one in its place."""
    return len(now) == 2 and victim not in now and bool(set(now) - set(before))


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until true or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def settled(fleet: Any, replicas: int = 2) -> bool:
    """The stable version runs exactly `replicas` replicas, none starting or stopping."""
    from ray import serve

    app = serve.status().applications[fleet.describe()["stable"]]
    states = app.deployments["verifier"].replica_states
    return states.get("RUNNING", 0) == replicas and sum(states.values()) == replicas


def draft_agreement(target: PreTrainedModel, draft: PreTrainedModel, prompt: list[int]) -> float:
    """Share of the target's greedy continuation of `prompt` that the draft predicts token by token."""
    continuation = greedy(target, prompt, NEW_TOKENS)
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([prompt + continuation])).logits  # type: ignore[operator]
    guesses = logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    return sum(g == t for g, t in zip(guesses, continuation, strict=True)) / len(continuation)


def calls(fleet: Any, replica: str) -> int:
    """Calls the ingress has relayed to `replica` (its per-replica figures)."""
    figures = fleet.ingress.fleet_stats.remote().result()["replicas"]
    return int(figures.get(replica, {}).get("calls", 0))


def wait_until_routed_to(fleet: Any, replica: str, prompt: list[int], timeout_s: float) -> None:
    """Send one-token Generates through the ingress until one reaches `replica`.

    A replica set back to SERVING is routed to again only once its next routing-stats
    report reaches the routers; sessions opened before then all land on the other one, and
    the token-aware policy later spills some of them (a reopen) to even the load.
    """
    before = calls(fleet, replica)
    with VerifierClient(ClientConfig(f"127.0.0.1:{fleet.port}")) as client:
        wait_for(
            lambda: bool(list(client.generate(prompt, 1))) and calls(fleet, replica) > before,
            timeout_s,
            f"the routers to send calls to {replica} again",
        )
