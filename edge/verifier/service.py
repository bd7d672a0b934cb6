"""gRPC servicer of the verifier: maps proto messages to engine calls and engine errors to codes.

Every handler has one shape, `_handle`: time the call, validate and submit off the
event loop, await the engine, map a VerifierError to its status code, count the
outcome (OK, the error's code, CANCELLED, UNKNOWN). Each answer says how long the
verifier worked on it (`fedge.edge.proto.timing`: a unary call's trailing metadata, a
Generate's initial metadata before its first reply), so the edge times the network
alone. Callers that go away are handled where they can leave work behind: an abandoned
submit is cancelled, and a session opened for a caller that left is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import NoReturn, TypeVar

import grpc

from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.proto.timing import server_ms_metadata
from fedge.edge.verifier.auth import AUTH_HEADER, CALLER
from fedge.edge.verifier.engine import (
    Sampling,
    SessionInfo,
    TokenChannel,
    VerifierEngine,
    VerifyResult,
)
from fedge.edge.verifier.errors import (
    VERSION_GONE_KEY,
    InvalidRequest,
    LengthMismatch,
    NotReady,
    Overloaded,
    SessionBusy,
    SessionNotFound,
    VerifierError,
    VersionGone,
)
from fedge.edge.verifier.limits import RETRY_AFTER_KEY
from fedge.edge.verifier.metrics import VerifierMetrics

R = TypeVar("R")
VALIDATION_THREADS = 2  # request validation and densifying run here, off the event loop
# A batching Generate caller's tokens gather this long before they leave in one reply. One reply
# per token kept the event loop on the interpreter lock for about a third of a streaming
# verifier's samples (py-spy --gil, a 6x256 target) and cost ~0.25 ms of CPU per token (micro
# zoo: 1.54 -> 1.30 ms per token batched); 20 ms is below what a reader notices.
STREAM_HOLD_S = 0.02

STATUS_OF: dict[type[VerifierError], grpc.StatusCode] = {
    VersionGone: grpc.StatusCode.FAILED_PRECONDITION,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionBusy: grpc.StatusCode.FAILED_PRECONDITION,
    LengthMismatch: grpc.StatusCode.ABORTED,
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


def info_message(info: SessionInfo) -> pb.SessionInfo:
    """A session's limits as the proto message."""
    return pb.SessionInfo(
        vocab_size=info.vocab_size,
        max_draft=info.max_draft,
        max_context=info.max_context,
        session_ttl_s=info.session_ttl_s,
        model_id=info.model_id,
        adapter_id=info.adapter_id,
        tokenizer_id=info.tokenizer_id,
    )


def owner_of(context: grpc.aio.ServicerContext) -> str:
    """Session owner: the authenticated caller; without auth, a digest of any bearer token sent."""
    caller = CALLER.get()
    if caller is not None:
        return caller
    for key, value in context.invocation_metadata() or ():
        if key == AUTH_HEADER:
            return hashlib.sha256(str(value).encode()).hexdigest()[:16]
    return ""


class VerifierService(pb_grpc.VerifierServicer):
    """Thin servicer: the engine validates; `_handle` maps outcomes to codes and metrics."""

    def __init__(
        self,
        engine_ref: Callable[[], VerifierEngine | None],
        metrics: VerifierMetrics,
        stream_hold_s: float = STREAM_HOLD_S,
    ) -> None:
        self._engine_ref = engine_ref
        self._metrics = metrics
        self._stream_hold_s = stream_hold_s
        self._pool = ThreadPoolExecutor(VALIDATION_THREADS, thread_name_prefix="verifier-validate")

    def _engine(self) -> VerifierEngine:
        """The running engine, or NotReady while the model loads, the server drains or it died."""
        engine = self._engine_ref()
        if engine is None or not engine.running:
            raise NotReady("verifier is loading its model, draining or down; retry shortly")
        return engine

    def _count(self, method: str, code: str) -> None:
        """Count one call's outcome."""
        self._metrics.requests.labels(method=method, code=code).inc()

    async def _handle(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        work: Callable[[VerifierEngine], Awaitable[R]],
        started: float | None = None,
        last: bool = True,
    ) -> R:
        """Run `work` on the engine; a VerifierError ends the call with its mapped status.

        A stream runs one `_handle` per step; only its `last` step counts OK and latency, and
        sets the trailing `fedge-server-ms` (a unary call's: its reply follows at once).
        """
        started = time.perf_counter() if started is None else started
        try:
            result = await work(self._engine())
        except VerifierError as error:
            await self._abort(context, method, error)
        except asyncio.CancelledError:
            self._count(method, grpc.StatusCode.CANCELLED.name)
            raise
        except Exception:
            self._count(method, grpc.StatusCode.UNKNOWN.name)
            raise
        if last:
            self._ok(method, started)
            context.set_trailing_metadata(server_ms_metadata(started))
        return result

    def _ok(self, method: str, started: float) -> None:
        """Count a success and its latency."""
        self._count(method, "OK")
        self._metrics.latency.labels(method=method).observe(time.perf_counter() - started)

    async def _abort(
        self, context: grpc.aio.ServicerContext, method: str, error: VerifierError
    ) -> NoReturn:
        """Count the failure and end the call with the mapped status (abort raises)."""
        code = status_of(error)
        self._count(method, code.name)
        await context.abort(code, str(error), trailing_metadata=_trailing(error))
        raise AssertionError("grpc.aio context.abort returned instead of raising")

    async def _submit(
        self,
        submit: Callable[[], Future[R]],
        orphan: Callable[[R], None] | None = None,
    ) -> R:
        """Validate and queue off the event loop, then await the engine's result.

        The loop wakes once, for the result: the validation thread chains the engine's
        future to the one awaited here. If the caller goes away first, the queued work is
        cancelled (the engine skips it) and `orphan` receives a result produced anyway.
        """
        relay: Future[R] = Future()

        def queue_it() -> None:
            try:
                pending = submit()
            except BaseException as exc:  # the awaiting caller gets it
                with contextlib.suppress(InvalidStateError):
                    relay.set_exception(exc)
                return
            pending.add_done_callback(lambda done: _relay(done, relay))
            relay.add_done_callback(
                lambda awaited: _abandon(pending, orphan) if awaited.cancelled() else None
            )

        # run in a copy of this call's context, so the engine sees its trace context
        self._pool.submit(contextvars.copy_context().run, queue_it)
        return await asyncio.wrap_future(relay)

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenSessionReply:
        """Prefill the prompt into a new session with a server-chosen id."""
        owner = owner_of(context)

        async def work(engine: VerifierEngine) -> SessionInfo:
            sampling = sampling_from(request.sampling)
            return await self._submit(
                lambda: engine.submit_open(list(request.prompt_ids), sampling, owner=owner),
                lambda info: _close_quietly(engine, info.session_id, owner),
            )

        info = await self._handle("OpenSession", context, work)
        context.add_done_callback(  # the reply may still be lost (deadline): the id with it
            lambda done: (
                _close_quietly(self._engine_ref(), info.session_id, owner)
                if done.cancelled()
                else None
            )
        )
        return pb.OpenSessionReply(
            session_id=info.session_id,
            vocab_size=info.vocab_size,
            max_draft=info.max_draft,
            max_context=info.max_context,
            session_ttl_s=info.session_ttl_s,
            model_id=info.model_id,
            adapter_id=info.adapter_id,
            tokenizer_id=info.tokenizer_id,
        )

    async def Verify(
        self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifyReply:
        """Verify the draft in the next batched pass; (re)open the session first if asked to."""
        owner = owner_of(context)

        def submit(engine: VerifierEngine) -> Future[VerifyResult]:
            return engine.submit_verify(
                request.session_id,
                list(request.draft_ids),
                list(request.draft_probs),
                [(list(d.token_ids), list(d.probs)) for d in request.draft_dists],
                expected_length=request.expected_length,
                owner=owner,
            )

        async def work(engine: VerifierEngine) -> tuple[VerifyResult, SessionInfo | None]:
            try:
                return await self._submit(lambda: submit(engine)), None
            except SessionNotFound:
                if not request.committed_ids:
                    raise
            committed = list(request.committed_ids)
            if request.expected_length and request.expected_length != len(committed):
                raise InvalidRequest(
                    "expected_length",
                    f"{request.expected_length} differs from len(committed_ids)={len(committed)}",
                )
            sampling = sampling_from(request.sampling)
            info = await self._submit(
                lambda: engine.submit_open(
                    committed,
                    sampling,
                    request.session_id,
                    owner,
                    field="committed_ids",
                    version=request.version,
                ),
                lambda info: _close_quietly(engine, info.session_id, owner),
            )
            return await self._submit(lambda: submit(engine)), info

        result, opened = await self._handle("Verify", context, work)
        return pb.VerifyReply(
            accepted=result.accepted,
            next_token=result.next_token,
            session_length=result.session_length,
            opened=info_message(opened) if opened else None,
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionReply:
        """Free a session's KV cache."""
        owner = owner_of(context)

        async def work(engine: VerifierEngine) -> int:
            return engine.close(request.session_id, owner)

        return pb.CloseSessionReply(
            session_length=await self._handle("CloseSession", context, work)
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateReply]:
        """Cloud-only decoding: the engine streams tokens; a lone stream decodes back to back.

        With `batch_tokens` the first reply waits for nothing (it carries the tokens made by
        then) and later ones gather for `stream_hold_s` into one reply each. The initial metadata,
        sent just before the first reply, says how long the verifier took to it (the prompt's
        prefill, a first pass): the edge's round trip leaves that out. The stream is cancelled
        by a done-callback of the call, not a `finally`: a cancelled generator suspended at a
        `yield` runs its `finally` only when garbage collected.
        """
        owner = owner_of(context)
        started = time.perf_counter()
        stop = request.stop_token_id if request.HasField("stop_token_id") else None

        async def start(engine: VerifierEngine) -> TokenChannel:
            def submit() -> TokenChannel:
                return engine.submit_generate(
                    list(request.prompt_ids),
                    request.max_new_tokens,
                    sampling_from(request.sampling),
                    stop,
                    owner,
                )

            handoff = self._pool.submit(submit)
            try:
                return await asyncio.wrap_future(handoff)
            except asyncio.CancelledError:
                handoff.add_done_callback(lambda done: _cancel_stream(done))
                raise

        hold = [0.0]  # the first token leaves at once

        async def next_chunk(engine: VerifierEngine) -> list[int] | None:
            try:
                return await channel.next_chunk(hold[0])
            except asyncio.CancelledError:
                channel.cancel()
                raise

        channel = await self._handle("Generate", context, start, started, last=False)
        context.add_done_callback(lambda _: channel.cancel())
        first = True
        while (
            chunk := await self._handle("Generate", context, next_chunk, started, False)
        ) is not None:
            if first:
                await context.send_initial_metadata(server_ms_metadata(started))
                first = False
            if request.batch_tokens:
                yield pb.GenerateReply(token_id=chunk[0], more_token_ids=chunk[1:])
                hold[0] = self._stream_hold_s
            else:
                for token in chunk:
                    yield pb.GenerateReply(token_id=token)
        self._ok("Generate", started)


def _trailing(error: VerifierError) -> tuple[tuple[str, str], ...]:
    """What an error's status carries besides its message: the version served, a retry-after."""
    if isinstance(error, VersionGone):
        return ((VERSION_GONE_KEY, error.served),)
    if isinstance(error, Overloaded):
        return ((RETRY_AFTER_KEY, str(math.ceil(error.retry_after_s * 1000))),)
    return ()


def _cancel_stream(handoff: Future[TokenChannel]) -> None:
    """The caller left while its Generate was being queued: cancel the stream."""
    if not handoff.cancelled() and handoff.exception() is None:
        handoff.result().cancel()


def _relay(done: Future[R], relay: Future[R]) -> None:
    """Copy the engine's outcome to the future the caller awaits (unless the caller left)."""
    with contextlib.suppress(InvalidStateError):
        if done.cancelled():
            relay.cancel()
        elif (error := done.exception()) is not None:
            relay.set_exception(error)
        else:
            relay.set_result(done.result())


def _abandon(pending: Future[R], orphan: Callable[[R], None] | None) -> None:
    """The caller left: cancel its queued work; hand a result produced anyway to `orphan`."""
    pending.cancel()
    if orphan is not None:
        pending.add_done_callback(
            lambda done: (
                orphan(done.result()) if not done.cancelled() and done.exception() is None else None
            )
        )


def _close_quietly(engine: VerifierEngine | None, session_id: str, owner: str) -> None:
    """Free a session nobody will use; it may already be gone (evicted, cancelled)."""
    if engine is None:
        return
    try:
        engine.close(session_id, owner)
    except SessionNotFound:
        return
