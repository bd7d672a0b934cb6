"""The Verifier API for the edge: sessions that survive retries and restarts, and cloud-only streams.

Round trips: after the first session (a real OpenSession, to learn the verifier's limits) a
session is opened by its first Verify, which carries the prompt under an id the client chose;
CloseSession is not waited for. Recovery: the client keeps each session's committed tokens,
sends the expected length with every Verify and retries UNAVAILABLE / DEADLINE_EXCEEDED with
the same request (the verifier replays a verify it already applied), as it retries an
OpenSession (a session a lost attempt opened expires unused); NOT_FOUND reopens the
session from the committed tokens, ABORTED reopens it under a fresh id. When the verifier
stays unreachable for `unreachable_after_s`, calls raise `VerifierUnreachable`. A
CloseSession lost to a transient failure (an ingress that died with it) is sent again with
the client's next call, so the session does not hold memory and quota until its time-to-live.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
from opentelemetry.trace import TracerProvider

from fedge.edge.client.config import ClientConfig, TokenizerMismatch, VerifierUnreachable
from fedge.edge.client.transport import Transport
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto.streams import reply_tokens, resume_generate
from fedge.edge.proto.timing import server_seconds
from fedge.edge.tracing import VERIFY_SPAN
from fedge.edge.verifier.engine import Sampling, SessionInfo, VerifyResult
from fedge.edge.verifier.errors import VERSION_GONE_KEY

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# FAILED_PRECONDITION while retrying: the retry raced its own first attempt, which is still running
RETRY_RACE = grpc.StatusCode.FAILED_PRECONDITION


@dataclass
class EdgeSession:
    """What the edge knows of one of its sessions: enough to replay or reopen it anywhere."""

    wire_id: str  # the id on the verifier; a fresh one after ABORTED
    committed: list[int]  # prompt + every token the verifier has returned
    sampling: Sampling
    known: bool  # the verifier has (as far as we know) opened it
    version: str = ""  # model_id/adapter_id it was opened on ("" = not yet known)


class VerifierClient(Transport):
    """Blocking Verifier client; also the `VerifierLink` the speculative decoder drives."""

    def __init__(self, config: ClientConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.retries = 0  # transient failures retried
        self.reopens = 0  # sessions reopened after NOT_FOUND or ABORTED
        self.version_changes = 0  # sessions restarted on other weights after theirs were gone
        self.closes_resent = 0  # CloseSessions sent again after a transient failure
        self._limits: SessionInfo | None = None  # the verifier's, from the first open
        self._sessions: dict[str, EdgeSession] = {}
        self._lost_closes: set[str] = set()  # wire ids whose CloseSession never arrived
        self._lost_closes_lock = threading.Lock()  # gRPC's callback threads add to it

    def __enter__(self) -> VerifierClient:
        return self

    # ---- sessions -------------------------------------------------------------------------
    def open(self, prompt_ids: Sequence[int], sampling: Sampling | None = None) -> SessionInfo:
        """Start a session: a real OpenSession the first time, later opened by its first verify."""
        self._resend_lost_closes()
        sampling = sampling or Sampling()
        if self._limits is None:
            info = self.open_remote(prompt_ids, sampling)
            self._limits = info
            self._sessions[info.session_id] = EdgeSession(
                info.session_id, list(prompt_ids), sampling, known=True, version=info.version
            )
            return info
        local_id = uuid.uuid4().hex
        self._sessions[local_id] = EdgeSession(local_id, list(prompt_ids), sampling, known=False)
        limits = self._limits
        return replace(limits, session_id=local_id)

    def open_remote(self, prompt_ids: Sequence[int], sampling: Sampling) -> SessionInfo:
        """OpenSession: the verifier prefills the prompt now and picks the id.

        Transient failures are retried (`unreachable_after_s`), as a verify's are: the
        ingress that took the call may have died with the answer (the session it opened
        then goes unused, and the verifier drops it at its time-to-live).
        """
        request = pb.OpenSessionRequest(prompt_ids=list(prompt_ids), sampling=_sampling(sampling))
        retry = TransientRetries(self)
        while True:
            try:
                reply = self.unary(self.stub.OpenSession, request, pb.OpenSessionReply)
                break
            except grpc.RpcError as err:
                if err.code() not in TRANSIENT:  # type: ignore[attr-defined]
                    raise
                retry.wait(err)
        info = SessionInfo(
            reply.session_id,
            reply.vocab_size,
            reply.max_draft,
            reply.max_context,
            reply.session_ttl_s,
            reply.model_id,
            reply.adapter_id,
            reply.tokenizer_id,
        )
        self._check_tokenizer(info.tokenizer_id)
        return info

    def _check_tokenizer(self, served: str) -> None:
        """Refuse a verifier whose tokenizer is known and is not the draft's."""
        expected = self.config.tokenizer_id
        if expected and served and served != expected:
            raise TokenizerMismatch(
                f"verifier at {self.config.target} serves tokenizer {served}, the draft uses "
                f"{expected}: its ids would decode to other text; point the edge at a verifier "
                "of the draft's model family"
            )

    def verify(
        self,
        session_id: str,
        draft_ids: Sequence[int],
        draft_probs: Sequence[float] = (),
        draft_dists: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
    ) -> VerifyResult:
        """Send a draft; returns how many were accepted and the next token (retried, reopened)."""
        self._resend_lost_closes()
        request = pb.VerifyRequest(
            session_id=session_id,
            draft_ids=list(draft_ids),
            draft_probs=list(draft_probs),
            draft_dists=[
                pb.DraftDistribution(token_ids=list(ids), probs=list(probs))
                for ids, probs in draft_dists
            ],
        )
        session = self._sessions.get(session_id)
        with self.tracing.span(
            VERIFY_SPAN, **{"fedge.draft_tokens": len(request.draft_ids)}
        ) as span:
            if session is None:  # not opened through this client: a plain verify
                reply = self.unary(self.stub.Verify, request, pb.VerifyReply)
            else:
                reply = self._verify_session(session, request)
                if reply.HasField("opened"):
                    self._check_tokenizer(reply.opened.tokenizer_id)
                    session.version = f"{reply.opened.model_id}/{reply.opened.adapter_id}"
                session.known = True
                session.committed += [*draft_ids[: reply.accepted], reply.next_token]
            if span is not None:
                span.set_attribute("fedge.accepted_tokens", reply.accepted)
        return VerifyResult(reply.accepted, reply.next_token, reply.session_length)

    def _verify_session(self, session: EdgeSession, request: pb.VerifyRequest) -> pb.VerifyReply:
        """Verify with the expected length; retry transient failures, reopen a lost session."""
        request.session_id = session.wire_id
        request.expected_length = len(session.committed)
        if not session.known:
            self._attach_committed(session, request)
        retry = TransientRetries(self)
        while True:
            try:
                return self.unary(self.stub.Verify, request, pb.VerifyReply)
            except grpc.RpcError as err:
                code = err.code()  # type: ignore[attr-defined]
                if code == grpc.StatusCode.NOT_FOUND and not request.committed_ids:
                    self._attach_committed(session, request)
                    continue
                if code == RETRY_RACE and _version_gone(err):  # its weights are gone: go on
                    session.version = ""  # from the committed tokens on the version served now
                    self.version_changes += 1
                    self._attach_committed(session, request)
                    continue
                if code == grpc.StatusCode.ABORTED:  # diverged: start over under a new id
                    session.wire_id = request.session_id = uuid.uuid4().hex
                    self._attach_committed(session, request)
                    continue
                if code not in (*TRANSIENT, RETRY_RACE):
                    raise
                retry.wait(err)

    def _attach_committed(self, session: EdgeSession, request: pb.VerifyRequest) -> None:
        """Make the request (re)open the session from the edge's committed tokens."""
        self.reopens += int(session.known)
        del request.committed_ids[:]
        request.committed_ids.extend(session.committed)
        request.sampling.CopyFrom(_sampling(session.sampling))
        request.version = session.version

    def close(self, session_id: str) -> int:
        """Close a session without waiting (fire-and-forget); returns the tokens it held here."""
        session = self._sessions.pop(session_id, None)
        if session is not None and not session.known:
            return len(session.committed)  # the verifier never saw it
        wire_id = session.wire_id if session else session_id
        self._resend_lost_closes()
        self._send_close(wire_id)
        return len(session.committed) if session else 0

    def _send_close(self, wire_id: str) -> None:
        """CloseSession without waiting; if it fails in transit, it is kept for the next call."""
        call = self.send(self.stub.CloseSession, pb.CloseSessionRequest(session_id=wire_id))
        call.add_done_callback(lambda done: self._note_close(wire_id, done))

    def _note_close(self, wire_id: str, call: grpc.Future) -> None:
        """Keep `wire_id` when its close ended UNAVAILABLE / DEADLINE_EXCEEDED (never applied,
        or not known to be); any other answer (OK, NOT_FOUND: already gone) settles it."""
        if call.code() in TRANSIENT:  # type: ignore[attr-defined]
            with self._lost_closes_lock:
                self._lost_closes.add(wire_id)

    def _resend_lost_closes(self) -> None:
        """Send again each close that was lost (a second loss keeps it for the call after)."""
        with self._lost_closes_lock:
            lost, self._lost_closes = self._lost_closes, set()
        for wire_id in lost:
            self.closes_resent += 1
            self._send_close(wire_id)

    def close_remote(self, session_id: str) -> int:
        """CloseSession, waiting for the reply: the tokens the verifier held."""
        self._sessions.pop(session_id, None)
        reply = self.unary(
            self.stub.CloseSession,
            pb.CloseSessionRequest(session_id=session_id),
            pb.CloseSessionReply,
        )
        return int(reply.session_length)

    # ---- cloud-only -----------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_token_id: int | None = None,
    ) -> Iterator[int]:
        """Cloud-only decoding: yields the target's tokens as the server streams them."""
        for chunk in self.generate_chunks(prompt_ids, max_new_tokens, sampling, stop_token_id):
            yield from chunk

    def generate_chunks(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_token_id: int | None = None,
    ) -> Iterator[list[int]]:
        """Cloud-only decoding: yields the target's tokens a reply at a time.

        The request sets `batch_tokens`, so the verifier sends the first token alone and later
        ones a few at a time (at most ~20 ms late): fewer messages cost the verifier less.
        A stream cut by a transient failure (the ingress or verifier serving it was lost)
        resumes from the prompt plus the tokens already streamed, for the tokens still owed
        (`fedge.edge.proto.streams`, as the fleet's ingress resumes a stream whose replica died),
        retried within `unreachable_after_s` of the cut; the verifier's draws depend on the
        position, so the continuation is the one the cut stream would have sent.
        """
        self._resend_lost_closes()
        sampling = sampling or Sampling()
        original = pb.GenerateRequest(
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=_sampling(sampling),
            stop_token_id=stop_token_id,
            batch_tokens=True,
        )
        streamed: list[int] = []
        request: pb.GenerateRequest | None = original
        retry = TransientRetries(self)
        while request is not None:
            before = len(streamed)
            try:
                yield from self._stream(request, streamed)
                return
            except grpc.RpcError as err:
                if err.code() not in TRANSIENT:  # type: ignore[attr-defined]
                    raise
                if len(streamed) > before:  # it had streamed since the last cut: a new outage
                    retry = TransientRetries(self)
                retry.wait(err)
            request = resume_generate(original, streamed)

    def _stream(self, request: pb.GenerateRequest, streamed: list[int]) -> Iterator[list[int]]:
        """One Generate call: yields each reply's tokens, appending them to `streamed`."""

        def start() -> tuple[Iterator[pb.GenerateReply], pb.GenerateReply | None]:
            stream = self.stub.Generate(
                request, timeout=self.config.timeout_s, metadata=self.metadata
            )
            return stream, next(stream, None)  # a refusal (rate limit, overload) arrives here

        stream, first = self.attempt(request, start, _stream_server_s)
        for reply in itertools.chain([] if first is None else [first], stream):
            self.bytes_down += reply.ByteSize()
            tokens = reply_tokens(reply)
            streamed.extend(tokens)
            yield tokens


class TransientRetries:
    """Waits between the retries of one call after transient failures, doubling up to 0.5 s;
    past `unreachable_after_s` from the first call, VerifierUnreachable instead."""

    def __init__(self, client: VerifierClient) -> None:
        self.client = client
        self.delay = client.config.backoff_s
        self.give_up = time.monotonic() + client.config.unreachable_after_s

    def wait(self, err: grpc.RpcError) -> None:
        """Wait before the next retry after `err`, or raise VerifierUnreachable."""
        config = self.client.config
        if time.monotonic() > self.give_up:
            raise VerifierUnreachable(
                f"verifier at {config.target} answered {err.code().name} for "  # type: ignore[attr-defined]
                f"{config.unreachable_after_s} s; decode on the device"
            ) from err
        self.client.retries += 1
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, 0.5)


def _stream_server_s(started: tuple[Any, pb.GenerateReply | None]) -> float | None:
    """The verifier's time to a stream's first reply, from the call's initial metadata (a traced
    channel's stream keeps it: `fedge.edge.tracing.traced_channel`)."""
    initial_metadata = getattr(started[0], "initial_metadata", None)
    return server_seconds(initial_metadata()) if initial_metadata is not None else None


def _version_gone(err: grpc.RpcError) -> bool:
    """Whether a FAILED_PRECONDITION says the session's version is no longer served."""
    trailing = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    return any(key == VERSION_GONE_KEY for key, _ in trailing)


def _sampling(sampling: Sampling) -> pb.Sampling:
    """The engine's Sampling as the proto message."""
    return pb.Sampling(temperature=sampling.temperature, seed=sampling.seed)
