"""gRPC servicer of the verifier: maps proto messages to engine calls and engine errors to codes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import NoReturn

import grpc

from edge.proto import verifier_pb2 as pb
from edge.proto import verifier_pb2_grpc as pb_grpc
from edge.verifier.engine import Sampling, SessionInfo, VerifierEngine
from edge.verifier.errors import (
    InvalidRequest,
    NotReady,
    Overloaded,
    SessionBusy,
    SessionNotFound,
    VerifierError,
)
from edge.verifier.metrics import VerifierMetrics

STATUS_OF: dict[type[VerifierError], grpc.StatusCode] = {
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionBusy: grpc.StatusCode.FAILED_PRECONDITION,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
}


def status_of(error: VerifierError) -> grpc.StatusCode:
    """The gRPC status an engine error maps to (INTERNAL for an unmapped one)."""
    for kind, code in STATUS_OF.items():
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def sampling_from(message: pb.Sampling) -> Sampling:
    """Proto sampling fields to the engine's Sampling."""
    return Sampling(temperature=float(message.temperature), seed=int(message.seed))


class VerifierService(pb_grpc.VerifierServicer):
    """Thin servicer: each handler validates nothing itself; the engine does, the codes come from STATUS_OF."""

    def __init__(
        self, engine_ref: Callable[[], VerifierEngine | None], metrics: VerifierMetrics
    ) -> None:
        self._engine_ref = engine_ref
        self._metrics = metrics

    def _engine(self) -> VerifierEngine:
        """The running engine, or NotReady while the model loads or the server drains."""
        engine = self._engine_ref()
        if engine is None or not engine.running:
            raise NotReady("verifier is loading its model or draining; retry shortly")
        return engine

    async def _abort(
        self, context: grpc.aio.ServicerContext, method: str, error: VerifierError
    ) -> NoReturn:
        """Count the failure and end the call with the mapped status (abort raises)."""
        code = status_of(error)
        self._metrics.requests.labels(method=method, code=code.name).inc()
        await context.abort(code, str(error))
        raise AssertionError("grpc.aio context.abort returned instead of raising")

    def _ok(self, method: str, started: float) -> None:
        """Count a success and its latency."""
        self._metrics.requests.labels(method=method, code="OK").inc()
        self._metrics.latency.labels(method=method).observe(time.perf_counter() - started)

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenSessionReply:
        """Prefill the prompt into a new session."""
        started = time.perf_counter()
        try:
            engine = self._engine()
            future = engine.submit_open(list(request.prompt_ids), sampling_from(request.sampling))
            info = await _opened(engine, future)
        except VerifierError as error:
            await self._abort(context, "OpenSession", error)
        self._ok("OpenSession", started)
        return pb.OpenSessionReply(
            session_id=info.session_id,
            vocab_size=info.vocab_size,
            max_draft=info.max_draft,
            max_context=info.max_context,
            session_ttl_s=info.session_ttl_s,
        )

    async def Verify(
        self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifyReply:
        """Queue the draft for the next batched pass and await its verdict."""
        started = time.perf_counter()
        try:
            future = self._engine().submit_verify(
                request.session_id,
                list(request.draft_ids),
                list(request.draft_probs),
                [(list(d.token_ids), list(d.probs)) for d in request.draft_dists],
            )
            result = await asyncio.wrap_future(future)
        except VerifierError as error:
            await self._abort(context, "Verify", error)
        self._ok("Verify", started)
        return pb.VerifyReply(
            accepted=result.accepted,
            next_token=result.next_token,
            session_length=result.session_length,
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionReply:
        """Free a session's KV cache."""
        started = time.perf_counter()
        try:
            length = self._engine().close(request.session_id)
        except VerifierError as error:
            await self._abort(context, "CloseSession", error)
        self._ok("CloseSession", started)
        return pb.CloseSessionReply(session_length=length)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateReply]:
        """Cloud-only decoding: one empty-draft verify per token, batched with everyone else's."""
        started = time.perf_counter()
        session_id = ""
        try:
            engine = self._engine()
            prompt = list(request.prompt_ids)
            room = engine.max_context - len(prompt)
            if not 1 <= request.max_new_tokens <= max(room, 1):
                raise InvalidRequest(
                    "max_new_tokens",
                    f"{request.max_new_tokens} is outside 1 .. {room} for a {len(prompt)}-token prompt",
                )
            info = await _opened(
                engine, engine.submit_open(prompt, sampling_from(request.sampling))
            )
            session_id = info.session_id
            for _ in range(request.max_new_tokens):
                result = await asyncio.wrap_future(engine.submit_verify(session_id, []))
                yield pb.GenerateReply(token_id=result.next_token)
                if request.HasField("stop_token_id") and result.next_token == request.stop_token_id:
                    break
        except VerifierError as error:
            await self._abort(context, "Generate", error)
        finally:
            if session_id:
                _close_quietly(self._engine_ref(), session_id)
        self._ok("Generate", started)


async def _opened(engine: VerifierEngine, future: Future[SessionInfo]) -> SessionInfo:
    """Await a session open; if the caller goes first, close the session once it exists."""
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda done: _close_orphan(engine, done))
        raise


def _close_orphan(engine: VerifierEngine, future: Future[SessionInfo]) -> None:
    """Close the session an abandoned open created (nothing if the open never ran)."""
    if not future.cancelled() and future.exception() is None:
        _close_quietly(engine, future.result().session_id)


def _close_quietly(engine: VerifierEngine | None, session_id: str) -> None:
    """Free a Generate stream's session; it may already be gone (evicted, cancelled)."""
    if engine is None:
        return
    try:
        engine.close(session_id)
    except SessionNotFound:
        return
