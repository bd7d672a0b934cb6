"""Batching verification engine: concurrent sessions' drafts verified in one target forward pass.

Plain Python and torch, no gRPC: a single worker thread owns the model. Verify
requests queue up; the worker takes the first, waits up to `batch_window_s` for
more (up to `max_batch`), left-pads the sessions' KV caches to a common length,
right-pads their drafts, and runs one forward with a padding attention mask and
per-session position ids. Each session then gets its own verdict
(`edge.speculative`) and keeps the KV of its accepted tokens only.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from edge import _hf
from edge.speculative import greedy_choices_verdict, sampling_verdict
from edge.tracing import NO_TRACING, Tracing
from edge.verifier.batching import KVGeometry, batched_forward
from edge.verifier.errors import (
    InvalidRequest,
    LengthMismatch,
    NotReady,
    Overloaded,
    SessionBusy,
)
from edge.verifier.requests import (
    Draft,
    Sampling,
    SessionInfo,
    VerifyResult,
    check_ids,
    check_sampling,
    check_session_id,
    derive_seed,
    sampling_draft,
)
from edge.verifier.sessions import Replay, Session, SessionStore

LOG = logging.getLogger("fedge.verifier")
ACTIVE_WINDOW_S = 0.05  # a session used this recently counts as a stream a batch should wait for

__all__ = [
    "EngineConfig",
    "EngineObserver",
    "Sampling",
    "SessionInfo",
    "VerifierEngine",
    "VerifyResult",
]


@dataclass(frozen=True)
class EngineConfig:
    """Limits and batching knobs of the verifier engine."""

    max_draft: int = 16  # acceptance decays geometrically; longer drafts rarely pay
    max_context: int = 0  # 0 = the model's max_position_embeddings
    max_sessions: int = 1024
    max_sessions_per_token: int = 0  # per bearer token; 0 = max_sessions (no quota)
    session_ttl_s: float = 300.0  # idle sessions expire; the edge reopens with its prompt
    kv_cap_bytes: int = 1 << 30
    batch_window_s: float = 0.002  # wait this long for concurrent verifies to join a batch
    max_batch: int = 32
    max_queue: int = 512  # queued requests beyond this are refused (backpressure)
    torch_threads: int = (
        0  # intra-op threads of the worker; 0 = those of the thread building the engine
    )

    def __post_init__(self) -> None:
        positive = {
            "max_draft": self.max_draft,
            "max_sessions": self.max_sessions,
            "session_ttl_s": self.session_ttl_s,
            "kv_cap_bytes": self.kv_cap_bytes,
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {value}")
        if self.torch_threads < 0:
            raise ValueError(f"EngineConfig.torch_threads must be >= 0, got {self.torch_threads}")
        if not 0 <= self.max_sessions_per_token <= self.max_sessions:
            raise ValueError(
                f"EngineConfig.max_sessions_per_token must lie in [0, max_sessions="
                f"{self.max_sessions}], got {self.max_sessions_per_token}"
            )
        if self.max_context < 0:
            raise ValueError(f"EngineConfig.max_context must be >= 0, got {self.max_context}")
        if self.batch_window_s < 0:
            raise ValueError(f"EngineConfig.batch_window_s must be >= 0, got {self.batch_window_s}")


class EngineObserver(Protocol):
    """Hooks the server uses for metrics; the engine calls them from its worker thread."""

    def on_batch(self, size: int, seconds: float) -> None: ...

    def on_verify(self, drafted: int, accepted: int) -> None: ...

    def on_sessions(self, count: int, kv_bytes: int) -> None: ...

    def on_evict(self, reason: str) -> None: ...

    def on_abandoned(self, kind: str) -> None: ...


class _NullObserver:
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


@dataclass
class _PrefillJob:
    prompt: list[int]
    sampling: Sampling
    future: Future[SessionInfo]
    session_id: str  # chosen by the edge, or a fresh uuid
    owner: str


@dataclass
class _VerifyJob:
    session: Session
    draft: Draft
    future: Future[VerifyResult]
    trace: Any = None  # the caller's OpenTelemetry context (edge.tracing), None when off
    queued_ns: int = 0


_Job = _PrefillJob | _VerifyJob


def _resolve(future: Future[Any], result: object) -> None:
    """Hand `result` to a future; a future nobody waits on any more (cancelled) is skipped."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def _reject(future: Future[Any], error: BaseException) -> None:
    """Hand `error` to a future; a future nobody waits on any more (cancelled) is skipped."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


class VerifierEngine:
    """Owns the target model, the session store and the batching worker thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig | None = None,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.observer: EngineObserver = observer or _NullObserver()
        self.tracing = tracing
        self._batch_ids = itertools.count(1)
        model_cfg: Any = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        limit = int(getattr(model_cfg, "max_position_embeddings", 0) or 0)
        self.max_context = self.config.max_context or limit
        if limit and self.max_context > limit:
            raise ValueError(
                f"EngineConfig.max_context={self.max_context} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        self.geometry = KVGeometry.of(model)
        self.bytes_per_position = self.geometry.bytes_per_position
        self.sessions = SessionStore(
            self.config.max_sessions,
            self.config.session_ttl_s,
            self.config.kv_cap_bytes,
            clock=clock,
            on_evict=lambda reason: self.observer.on_evict(reason),
            owner_quota=self.config.max_sessions_per_token,
        )
        self._clock = clock
        self._threads = self.config.torch_threads or torch.get_num_threads()
        self._queue: queue.Queue[_Job] = queue.Queue(self.config.max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.death: BaseException | None = None  # what ended the worker, when it died
        self._on_death: list[Callable[[BaseException], None]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VerifierEngine:
        """Start the worker thread; returns self."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="verifier-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the worker after the request in hand; queued requests fail with NotReady."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fail_queued(NotReady("verifier is shutting down; retry elsewhere"))

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` from the worker thread if the worker ever dies."""
        self._on_death.append(callback)

    @property
    def running(self) -> bool:
        """True while the worker thread is alive and accepting work."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the worker."""
        return self._queue.qsize()

    def _fail_queued(self, error: BaseException) -> None:
        """Fail every queued request with `error`, releasing their sessions."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _VerifyJob):
                job.session.busy = False
            _reject(job.future, error)

    # ------------------------------------------------------------------ requests
    def submit_open(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        session_id: str | None = None,
        owner: str = "",
        field: str = "prompt_ids",
    ) -> Future[SessionInfo]:
        """Queue a session open (prompt prefill) under `session_id` (default: a fresh id)."""
        sid = uuid.uuid4().hex if session_id is None else check_session_id(session_id)
        prompt = check_ids(field, prompt_ids, self.vocab_size)
        if not 1 <= len(prompt) < self.max_context:
            raise InvalidRequest(
                field,
                f"{len(prompt)} tokens; a prompt must hold 1 .. {self.max_context - 1} tokens "
                f"(max_context {self.max_context}); shorten it",
            )
        check_sampling(sampling)
        future: Future[SessionInfo] = Future()
        self._enqueue(_PrefillJob(prompt, sampling, future, sid, owner))
        return future

    def submit_verify(
        self,
        session_id: str,
        draft_ids: Sequence[int],
        draft_probs: Sequence[float] = (),
        draft_dists: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
        expected_length: int = 0,
        owner: str = "",
    ) -> Future[VerifyResult]:
        """Queue a verify of `draft_ids`; the future yields the VerifyResult.

        `expected_length` > 0 makes it idempotent: a retry of the session's last verify
        (same expected length and draft) gets that verify's result again.
        """
        session = self.sessions.get(session_id, owner)
        draft = self._check_draft(session, draft_ids, draft_probs, draft_dists)
        future: Future[VerifyResult] = Future()
        with self.sessions.lock:
            replay = self._replay(session, draft.ids, expected_length)
            if replay is not None:
                future.set_result(replay)
                return future
            self._claim(session)
        try:
            trace = self.tracing.capture()
            queued = time.time_ns() if trace is not None else 0
            self._enqueue(_VerifyJob(session, draft, future, trace, queued))
        except Exception:
            session.busy = False
            raise
        return future

    def _replay(
        self, session: Session, draft_ids: list[int], expected_length: int
    ) -> VerifyResult | None:
        """None to verify afresh; the stored result for a retry; LengthMismatch otherwise."""
        if not expected_length or expected_length == session.length or session.busy:
            return None  # a busy session: _claim refuses, the retry comes back after the reply
        last = session.last
        if last and last.start_length == expected_length and list(last.draft_ids) == draft_ids:
            return last.result
        raise LengthMismatch(
            f"expected_length: session {session.session_id!r} holds {session.length} tokens, "
            f"the request expects {expected_length} and is no retry of its last verify; "
            "reopen under a new session id with your committed tokens"
        )

    def close(self, session_id: str, owner: str = "") -> int:
        """Close a session; returns the number of tokens it held."""
        session = self.sessions.remove(session_id, owner)
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)
        return session.length

    def open(self, prompt_ids: Sequence[int], sampling: Sampling | None = None) -> SessionInfo:
        """Blocking `submit_open`."""
        return self.submit_open(prompt_ids, sampling or Sampling()).result()

    def verify(
        self,
        session_id: str,
        draft_ids: Sequence[int],
        draft_probs: Sequence[float] = (),
        draft_dists: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
    ) -> VerifyResult:
        """Blocking `submit_verify`."""
        return self.submit_verify(session_id, draft_ids, draft_probs, draft_dists).result()

    def _check_draft(
        self,
        session: Session,
        draft_ids: Sequence[int],
        draft_probs: Sequence[float],
        draft_dists: Sequence[tuple[Sequence[int], Sequence[float]]],
    ) -> Draft:
        """Validate a draft against the vocabulary, max_draft, the context, and the sampling mode."""
        ids = check_ids("draft_ids", draft_ids, self.vocab_size)
        if len(ids) > self.config.max_draft:
            raise InvalidRequest(
                "draft_ids", f"{len(ids)} tokens exceed max_draft {self.config.max_draft}"
            )
        if session.length + len(ids) + 1 > self.max_context:
            raise InvalidRequest(
                "draft_ids",
                f"session holds {session.length} tokens; {len(ids)} more plus the next token "
                f"pass max_context {self.max_context}; close it and open a new session",
            )
        if session.temperature == 0.0:
            return Draft(ids)
        return sampling_draft(ids, draft_probs, draft_dists, self.vocab_size)

    def _claim(self, session: Session) -> None:
        """Mark `session` busy, refusing a second verify in flight."""
        with self.sessions.lock:
            if session.busy:
                raise SessionBusy(
                    f"session {session.session_id!r} already has a verify in flight; "
                    "wait for its reply"
                )
            session.busy = True

    def _enqueue(self, job: _Job) -> None:
        """Put a job on the queue; NotReady if stopped, Overloaded if the queue is full."""
        if not self.running:
            raise NotReady("verifier engine is not running (loading or draining); retry shortly")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(
                f"verify queue is full ({self.config.max_queue} requests); back off and retry"
            ) from None

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        """Worker loop: take a job, gather a batch of verifies, run it, repeat; report death."""
        # OpenMP thread counts are per calling thread: a new thread does not inherit its creator's
        torch.set_num_threads(self._threads)
        try:
            while not self._stop.is_set():
                in_hand: list[_Job] = []
                try:
                    self._step(in_hand)
                except Exception as exc:  # a bug must cost its own requests, not the worker
                    LOG.exception("verifier engine step failed; failing its requests")
                    self._abort_jobs(in_hand, exc)
        except BaseException as exc:  # anything that gets here ends the worker: say so
            self._died(exc)

    def _abort_jobs(self, jobs: list[_Job], error: BaseException) -> None:
        """Fail jobs whose step broke, releasing their sessions."""
        for job in jobs:
            if isinstance(job, _VerifyJob):
                job.session.busy = False
            _reject(job.future, error)

    def _died(self, error: BaseException) -> None:
        """Record the worker's death, fail queued work, tell the server (health, exit)."""
        LOG.critical("verifier engine worker died: %r", error)
        self.death = error
        self._fail_queued(NotReady(f"verifier engine worker died ({error!r}); use another replica"))
        for callback in self._on_death:
            with contextlib.suppress(Exception):
                callback(error)

    def _step(self, in_hand: list[_Job]) -> None:
        """One turn of the worker: a prefill, or a batch of verifies plus deferred prefills."""
        try:
            first = self._queue.get(timeout=0.05)
        except queue.Empty:
            if self.sessions.expire():
                self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)
            return
        in_hand.append(first)
        if isinstance(first, _PrefillJob):
            self._guarded(first, self._prefill)
            return
        batch, deferred = self._gather(first)
        in_hand.extend([*batch[1:], *deferred])
        self._run_batch([job for job in batch if self._take(job)])
        for job in deferred:
            self._guarded(job, self._prefill)

    def _take(self, job: _Job) -> bool:
        """Claim a job for running; False (and its session released) if its caller is gone."""
        if job.future.set_running_or_notify_cancel():
            return True
        if isinstance(job, _VerifyJob):
            job.session.busy = False
        self.observer.on_abandoned("verify" if isinstance(job, _VerifyJob) else "open")
        return False

    def _gather(self, first: _VerifyJob) -> tuple[list[_VerifyJob], list[_PrefillJob]]:
        """Collect verifies arriving within the batching window; prefills wait for the next turn.

        The window applies only while other sessions are active: a lone stream runs at once.
        """
        batch, deferred = [first], []
        window = self.config.batch_window_s
        if self.sessions.active_since(self._clock() - ACTIVE_WINDOW_S) <= 1:
            window = 0.0  # a lone stream: nobody to wait for, so no batching delay
        deadline = time.monotonic() + window
        while len(batch) < self.config.max_batch:
            remaining = deadline - time.monotonic()
            try:
                job = (
                    self._queue.get(timeout=remaining)
                    if remaining > 0
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if isinstance(job, _VerifyJob):
                batch.append(job)
            else:
                deferred.append(job)
        return batch, deferred

    def _guarded(self, job: _PrefillJob, fn: Callable[[_PrefillJob], SessionInfo]) -> None:
        """Run a prefill unless its caller is gone, routing any error to its future."""
        if not self._take(job):
            return
        try:
            _resolve(job.future, fn(job))
        except Exception as exc:  # the future carries it to the caller
            _reject(job.future, exc)

    @torch.no_grad()
    def _prefill(self, job: _PrefillJob) -> SessionInfo:
        """Fill the KV cache with all prompt tokens but the last, which stays pending."""
        self.sessions.reserve(len(job.prompt) * self.bytes_per_position, keep=set())
        head = job.prompt[:-1]
        if head:
            _, layers = _hf.forward(self.model, torch.tensor([head]), None)
            kv = _hf.stack_kv(layers)
        else:
            kv = self.geometry.empty()
        seed = job.sampling.seed or derive_seed(job.session_id)
        session = Session(
            session_id=job.session_id,
            kv=kv,
            pending=job.prompt[-1],
            temperature=job.sampling.temperature,
            generator=torch.Generator().manual_seed(seed),
            last_used=self._clock(),
            owner=job.owner,
        )
        self.sessions.add(session)
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)
        return SessionInfo(
            job.session_id,
            self.vocab_size,
            self.config.max_draft,
            self.max_context,
            self.config.session_ttl_s,
        )

    def _run_batch(self, batch: list[_VerifyJob]) -> None:
        """Verify a batch in one forward; every job's future gets a result or an error."""
        if not batch:
            return
        started = time.monotonic()
        times_ns = [time.time_ns()]  # batch start, forward start, forward end, verdicts start
        try:
            keep = {job.session.key for job in batch}
            growth = sum(len(job.draft.ids) + 1 for job in batch) * self.bytes_per_position
            self.sessions.reserve(growth, keep)
            times_ns.append(time.time_ns())
            logits, new_kv = batched_forward(
                self.model,
                self.geometry,
                [job.session.kv for job in batch],
                [[job.session.pending, *job.draft.ids] for job in batch],
            )
            times_ns.append(time.time_ns())
        except Exception as exc:
            for job in batch:
                job.session.busy = False
                _reject(job.future, exc)
            return
        choices = logits.argmax(dim=-1).tolist()  # [B, T]: all greedy sessions need
        times_ns.append(time.time_ns())  # before any caller can have its reply
        for row, job in enumerate(batch):
            try:
                result = self._commit(job, row, logits, choices[row], new_kv)
            except Exception as exc:
                job.session.busy = False
                _reject(job.future, exc)
            else:
                job.session.busy = False  # before the reply: the caller may verify again at once
                _resolve(job.future, result)
        self.observer.on_batch(len(batch), time.monotonic() - started)
        if self.tracing.tracer is not None:
            self.tracing.record_batch(
                [job.trace for job in batch],
                next(self._batch_ids),
                (times_ns[0], times_ns[1], times_ns[2], times_ns[3]),
                [job.queued_ns for job in batch],
            )
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)

    def _commit(
        self,
        job: _VerifyJob,
        row: int,
        logits: torch.Tensor,
        choices: list[int],
        new_kv: torch.Tensor,
    ) -> VerifyResult:
        """Decide the verdict for one session and keep the KV of its accepted tokens."""
        session, draft = job.session, job.draft
        k = len(draft.ids)
        if draft.probs is None or draft.dists is None:  # greedy session (see _check_draft)
            verdict = greedy_choices_verdict(draft.ids, choices[: k + 1])
        else:
            probs = torch.softmax(logits[row, : k + 1].double() / session.temperature, dim=-1)
            verdict = sampling_verdict(
                draft.ids, draft.probs, draft.dists, probs, session.generator
            )
        start = session.length
        keep = verdict.accepted + 1  # the pending token plus the accepted drafts
        kv = torch.cat([session.kv, new_kv[row : row + 1, :, :, :keep]], dim=3)
        self.sessions.set_kv(session, kv)
        session.pending = verdict.next_token
        session.last_used = self._clock()
        self.observer.on_verify(k, verdict.accepted)
        result = VerifyResult(verdict.accepted, verdict.next_token, session.length)
        session.last = Replay(start, tuple(draft.ids), result)
        return result
