"""The engine's work items and what its worker shares with it: jobs, streams, observer hooks."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedModel

from fedge.edge.tracing import Tracing
from fedge.edge.verifier.batching import KVGeometry
from fedge.edge.verifier.channel import TokenChannel
from fedge.edge.verifier.requests import Draft, Sampling, SessionInfo, VerifyResult
from fedge.edge.verifier.runtime import Runtime
from fedge.edge.verifier.sessions import Session, SessionStore


class EngineObserver(Protocol):
    """Hooks the server uses for metrics; the engine calls them from its worker thread."""

    def on_batch(self, size: int, seconds: float) -> None: ...

    def on_verify(self, drafted: int, accepted: int) -> None: ...

    def on_sessions(self, count: int, kv_bytes: int) -> None: ...

    def on_evict(self, reason: str) -> None: ...

    def on_abandoned(self, kind: str) -> None: ...


@dataclass
class PrefillJob:
    """Open a session: prefill all prompt tokens but the last."""

    prompt: list[int]
    sampling: Sampling
    future: Future[SessionInfo]
    session_id: str  # chosen by the edge, or a fresh uuid
    owner: str


@dataclass
class VerifyJob:
    """Verify one draft on one session."""

    session: Session
    draft: Draft
    future: Future[VerifyResult]
    trace: Any = None  # the caller's OpenTelemetry context (fedge.edge.tracing), None when off
    queued_ns: int = 0


@dataclass
class GenerateJob:
    """Decode up to `max_new_tokens` after `prompt` into `channel` (cloud-only Generate)."""

    prompt: list[int]
    sampling: Sampling
    max_new_tokens: int
    stop_token: int | None
    channel: TokenChannel
    owner: str


Job = PrefillJob | VerifyJob | GenerateJob


@dataclass
class Stream:
    """A running Generate: its job and its private session (busy for its whole life)."""

    job: GenerateJob
    session: Session
    finished: bool = False


@dataclass(frozen=True)
class WorkerParts:
    """What the worker shares with the engine that owns it."""

    model: PreTrainedModel
    geometry: KVGeometry
    sessions: SessionStore
    jobs: queue.Queue[Job]
    stop: threading.Event
    observer: EngineObserver
    tracing: Tracing
    clock: Callable[[], float]
    session_info: Callable[[str], SessionInfo]
    batch_window_s: float
    max_batch: int
    runtime: Runtime  # what runs the model: in this process, or on a ring for long prompts


def resolve(future: Future[Any], result: object) -> None:
    """Hand `result` to a future; a future nobody waits on any more (cancelled) is skipped."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def reject(future: Future[Any], error: BaseException) -> None:
    """Hand `error` to a future; a future nobody waits on any more (cancelled) is skipped."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


def fail_job(job: Job, error: BaseException) -> None:
    """End a job with `error`, releasing its session."""
    if isinstance(job, GenerateJob):
        job.channel.fail(error)
        return
    if isinstance(job, VerifyJob):
        job.session.busy = False
    reject(job.future, error)


class NullObserver:
    """Observer that records nothing."""

    def on_batch(self, size: int, seconds: float) -> None:
        return None

    def on_verify(self, drafted: int, accepted: int) -> None:
        return None

    def on_sessions(self, count: int, kv_bytes: int) -> None:
        return None

    def on_evict(self, reason: str) -> None:
        return None

    def on_abandoned(self, kind: str) -> None:
        return None
