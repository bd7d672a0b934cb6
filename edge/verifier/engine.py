"""Batching verification engine: the API of the verifier's model, without gRPC.

Plain Python and torch: callers validate and queue requests here (open, verify,
close, generate); a single worker thread (`fedge.edge.verifier.worker`) owns the model,
verifies concurrent sessions' drafts in one batched forward pass, and decodes
cloud-only Generate streams (a lone stream in a tight loop on its own cache object,
concurrent ones batched with everything else). Each verify gets its own verdict
(`fedge.edge.speculative`) and its session keeps the KV of its accepted tokens only.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from fedge.edge.tracing import NO_TRACING, Tracing
from fedge.edge.verifier.batching import KVGeometry
from fedge.edge.verifier.channel import TokenChannel
from fedge.edge.verifier.errors import (
    InvalidRequest,
    LengthMismatch,
    NotReady,
    Overloaded,
    SessionBusy,
    VersionGone,
)
from fedge.edge.verifier.identity import ServingIdentity
from fedge.edge.verifier.jobs import (
    EngineObserver,
    GenerateJob,
    Job,
    NullObserver,
    PrefillJob,
    VerifyJob,
    WorkerParts,
    fail_job,
)
from fedge.edge.verifier.requests import (
    Draft,
    Sampling,
    SessionInfo,
    VerifyResult,
    check_ids,
    check_sampling,
    check_session_id,
    sampling_draft,
)
from fedge.edge.verifier.ring import RingConfig
from fedge.edge.verifier.runtime import RUNTIMES, Runtime, build_runtime
from fedge.edge.verifier.sessions import Session, SessionStore
from fedge.edge.verifier.worker import Worker

LOG = logging.getLogger("fedge.verifier")
QUEUE_FULL_RETRY_S = 0.05  # retry-after of a full queue: the worker drains a batch in ms
DEFAULT_SESSIONS_PER_DEVICE = 16  # the per-device quota nobody configured (identified devices)

__all__ = [
    "EngineConfig",
    "EngineObserver",
    "Sampling",
    "SessionInfo",
    "TokenChannel",
    "VerifierEngine",
    "VerifyResult",
]


@dataclass(frozen=True)
class EngineConfig:
    """Limits and batching knobs of the verifier engine."""

    max_draft: int = 16  # acceptance decays geometrically; longer drafts rarely pay
    max_context: int = 0  # 0 = the model's max_position_embeddings
    max_sessions: int = 1024
    # sessions one device (authenticated identity) may hold: None = DEFAULT_SESSIONS_PER_DEVICE
    # (capped at max_sessions; unauthenticated callers, all one owner "", have none), 0 = off
    max_sessions_per_token: int | None = None
    session_ttl_s: float = 300.0  # idle sessions expire; the edge reopens with its prompt
    kv_cap_bytes: int = 1 << 30
    kv_cap_per_token_bytes: int = 0  # KV one device may hold; 0 = its fair share of the cap only
    batch_window_s: float = 0.002  # wait this long for concurrent verifies to join a batch
    max_batch: int = 32
    max_queue: int = 512  # queued requests beyond this are refused (backpressure)
    torch_threads: int = (
        0  # intra-op threads of the worker; 0 = those of the thread building the engine
    )
    # Ring attention (fedge.edge.verifier.ring): prompts longer than ring_threshold tokens are
    # prefilled by ring_size worker processes that keep the KV sharded. 0 = off.
    ring_size: int = 0
    ring_threshold: int = 2048
    ring_block: int = 256  # key positions per attention score block in a ring worker
    ring_kv_cap_bytes: int = 1 << 30  # KV each ring worker may hold
    ring_threads: int = 1  # intra-op threads per ring worker
    # The target's runtime (fedge.edge.verifier.runtime.build_runtime): "torch" (in process),
    # "onnx" (an ONNX Runtime export of the same weights, cached by their digest) or "auto"
    # (time both at start, keep the faster). torch here: an engine built in a program (tests,
    # benches, fleet replicas) does not pay an export (~15 s for the micro zoo) unasked; the
    # `fedge verifier serve` command defaults to auto.
    runtime: str = "torch"

    def ring(self) -> RingConfig | None:
        """The ring's configuration, or None when sharding is off."""
        if not self.ring_size:
            return None
        return RingConfig(
            size=self.ring_size,
            threshold=self.ring_threshold,
            block=self.ring_block,
            kv_cap_bytes=self.ring_kv_cap_bytes,
            threads=self.ring_threads,
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
        quota = self.max_sessions_per_token
        if quota is not None and not 0 <= quota <= self.max_sessions:
            raise ValueError(
                f"EngineConfig.max_sessions_per_token must lie in [0, max_sessions="
                f"{self.max_sessions}], got {self.max_sessions_per_token}"
            )
        if not 0 <= self.kv_cap_per_token_bytes <= self.kv_cap_bytes:
            raise ValueError(
                f"EngineConfig.kv_cap_per_token_bytes must lie in [0, kv_cap_bytes="
                f"{self.kv_cap_bytes}], got {self.kv_cap_per_token_bytes}"
            )
        if self.max_context < 0:
            raise ValueError(f"EngineConfig.max_context must be >= 0, got {self.max_context}")
        if self.batch_window_s < 0:
            raise ValueError(f"EngineConfig.batch_window_s must be >= 0, got {self.batch_window_s}")
        if self.ring_size < 0:
            raise ValueError(f"EngineConfig.ring_size must be >= 0, got {self.ring_size}")
        if self.runtime not in RUNTIMES:
            raise ValueError(
                f"EngineConfig.runtime must be one of {list(RUNTIMES)}, got {self.runtime!r}"
            )
        if self.runtime == "onnx" and self.ring_size:
            raise ValueError(
                f"EngineConfig.runtime='onnx' cannot serve with ring_size={self.ring_size}: "
                "ring attention's workers run torch; use runtime 'torch' or 'auto' with a ring, "
                "or ring_size 0 for ONNX Runtime"
            )
        self.ring()  # RingConfig names a bad ring field

    @property
    def sessions_per_owner(self) -> int:
        """The per-device session quota in force for an authenticated device (0 = off)."""
        if self.max_sessions_per_token is None:
            return min(DEFAULT_SESSIONS_PER_DEVICE, self.max_sessions)
        return self.max_sessions_per_token


class VerifierEngine:
    """Owns the target model, the session store and the batching worker thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig | None = None,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing = NO_TRACING,
        identity: ServingIdentity | None = None,
    ) -> None:
        self.model = model.eval()
        self.identity = identity or ServingIdentity()
        self.config = config or EngineConfig()
        self.observer: EngineObserver = observer or NullObserver()
        self.tracing = tracing
        model_cfg: Any = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        limit = int(getattr(model_cfg, "max_position_embeddings", 0) or 0)
        self.max_context = self.config.max_context or limit
        if limit and self.max_context > limit:
            raise ValueError(
                f"EngineConfig.max_context={self.max_context} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        self._threads = self.config.torch_threads or torch.get_num_threads()
        self.runtime: Runtime = build_runtime(
            self.model,
            KVGeometry.of(model),
            self.config.runtime,
            self.config.ring(),
            self._threads,
        )
        self.geometry = self.runtime.geometry  # an ONNX export holds fp32 KV whatever the model
        self.bytes_per_position = self.geometry.bytes_per_position
        self.sessions = SessionStore(
            self.config.max_sessions,
            self.config.session_ttl_s,
            self.config.kv_cap_bytes,
            clock=clock,
            on_evict=lambda reason: self.observer.on_evict(reason),
            owner_quota=self.config.max_sessions_per_token or 0,
            default_quota=self.config.sessions_per_owner,
            owner_kv_quota=self.config.kv_cap_per_token_bytes,
            on_remove=lambda session: self.runtime.release(session.cache),
        )
        self.runtime.on_lost(self._sharded_lost)
        self._clock = clock
        self._queue: queue.Queue[Job] = queue.Queue(self.config.max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.death: BaseException | None = None  # what ended the worker, when it died
        self._on_death: list[Callable[[BaseException], None]] = []
        self._worker = Worker(
            WorkerParts(
                model=self.model,
                geometry=self.geometry,
                sessions=self.sessions,
                jobs=self._queue,
                stop=self._stop,
                observer=self.observer,
                tracing=tracing,
                clock=clock,
                session_info=self._info,
                batch_window_s=self.config.batch_window_s,
                max_batch=self.config.max_batch,
                runtime=self.runtime,
            )
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VerifierEngine:
        """Start the worker thread; returns self."""
        if self._thread is None:
            self.runtime.start()
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
        stopping = NotReady("verifier is shutting down; retry elsewhere")
        self._fail_queued(stopping)
        self._worker.fail_streams(stopping)
        self.runtime.stop()

    def _sharded_lost(self) -> None:
        """The ring failed: its sessions' KV is gone, so they go (a verify reopens them)."""
        dropped = self.sessions.drop_where(lambda s: not self.runtime.batchable(s.cache))
        LOG.warning("ring failure dropped %d sharded session(s)", dropped)
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)

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
            fail_job(job, error)

    # ------------------------------------------------------------------ requests
    def submit_open(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        session_id: str | None = None,
        owner: str = "",
        field: str = "prompt_ids",
        version: str = "",
    ) -> Future[SessionInfo]:
        """Queue a session open (prompt prefill) under `session_id` (default: a fresh id).

        A `version` other than the one served (a reopen of a session opened on weights
        that are gone) is refused VersionGone.
        """
        if version and version != self.identity.version:
            raise VersionGone(version, self.identity.version)
        sid = uuid.uuid4().hex if session_id is None else check_session_id(session_id)
        prompt = self._check_prompt(field, prompt_ids)
        check_sampling(sampling)
        future: Future[SessionInfo] = Future()
        self._enqueue(PrefillJob(prompt, sampling, future, sid, owner))
        return future

    def submit_generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop_token_id: int | None = None,
        owner: str = "",
    ) -> TokenChannel:
        """Queue a cloud-only generation; tokens arrive on the returned channel.

        Generation ends after `max_new_tokens` or at `stop_token_id` (which is sent). A
        reader that goes away calls `channel.cancel()`; the worker then frees the stream.
        """
        prompt = self._check_prompt("prompt_ids", prompt_ids)
        room = self.max_context - len(prompt)
        if not 1 <= max_new_tokens <= room:
            raise InvalidRequest(
                "max_new_tokens",
                f"{max_new_tokens} is outside 1 .. {room} for a {len(prompt)}-token prompt "
                f"(max_context {self.max_context})",
            )
        stop = None
        if stop_token_id is not None:
            stop = check_ids("stop_token_id", [stop_token_id], self.vocab_size)[0]
        check_sampling(sampling)
        channel = TokenChannel()
        self._enqueue(GenerateJob(prompt, sampling, max_new_tokens, stop, channel, owner))
        return channel

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
            self._enqueue(VerifyJob(session, draft, future, trace, queued))
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

    def _check_prompt(self, field: str, prompt_ids: Sequence[int]) -> list[int]:
        """Prompt ids must lie in the vocabulary and leave room in the context."""
        prompt = check_ids(field, prompt_ids, self.vocab_size)
        if not 1 <= len(prompt) < self.max_context:
            raise InvalidRequest(
                field,
                f"{len(prompt)} tokens; a prompt must hold 1 .. {self.max_context - 1} tokens "
                f"(max_context {self.max_context}); shorten it",
            )
        return prompt

    def _info(self, session_id: str) -> SessionInfo:
        """What a client learns about a session it opened: the engine's limits."""
        return SessionInfo(
            session_id,
            self.vocab_size,
            self.config.max_draft,
            self.max_context,
            self.config.session_ttl_s,
            self.identity.model_id,
            self.identity.adapter_id,
            self.identity.tokenizer_id,
        )

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

    def _enqueue(self, job: Job) -> None:
        """Put a job on the queue; NotReady if stopped, Overloaded if the queue is full."""
        if not self.running:
            raise NotReady("verifier engine is not running (loading or draining); retry shortly")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(
                f"verify queue is full ({self.config.max_queue} requests); back off and retry",
                QUEUE_FULL_RETRY_S,
            ) from None

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        """Worker thread: turns of the worker until stopped; report its death if anything escapes."""
        # OpenMP thread counts are per calling thread: a new thread does not inherit its creator's
        torch.set_num_threads(self._threads)
        try:
            with torch.inference_mode():  # no autograd bookkeeping for any pass or cache update
                while not self._stop.is_set():
                    self._worker.step()
        except BaseException as exc:  # anything that gets here ends the worker: say so
            self._died(exc)

    def _died(self, error: BaseException) -> None:
        """Record the worker's death, fail queued work and streams, tell the server (health, exit)."""
        LOG.critical("verifier engine worker died: %r", error)
        self.death = error
        gone = NotReady(f"verifier engine worker died ({error!r}); use another replica")
        self._fail_queued(gone)
        self._worker.fail_streams(gone)
        for callback in self._on_death:
            with contextlib.suppress(Exception):
                callback(error)
