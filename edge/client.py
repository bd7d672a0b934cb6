"""Edge-side client of the verifier: sessions, verifies and cloud-only streaming over gRPC.

`VerifierClient` speaks the Verifier proto on a blocking channel and counts the
protobuf payload bytes it sends and receives (HTTP/2 framing and headers
excluded). For experiments it can add a round-trip time: it sleeps `added_rtt_s`
before each unary call and once before a stream's first message, which is what
a network of that round-trip time costs a call that waits for its reply.
RESOURCE_EXHAUSTED replies are retried: after the server's `fedge-retry-after-ms`
when it sends one (a per-device rate limit; beyond `max_wait_s` the call raises
`RateLimited` so the caller can take another route), else with exponential backoff.

Round trips and recovery: after the first session (a real OpenSession, to learn
the verifier's limits) a session is opened by its first Verify, which carries the
prompt under an id the client chose; CloseSession is not waited for. The client
keeps each session's committed tokens, sends the expected length with every
Verify and retries UNAVAILABLE / DEADLINE_EXCEEDED with the same request (the
verifier replays a verify it already applied); NOT_FOUND reopens the session from
the committed tokens, ABORTED reopens it under a fresh id. When the verifier stays
unreachable for `unreachable_after_s`, calls raise `VerifierUnreachable`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import TracerProvider

from edge.proto import verifier_pb2 as pb
from edge.proto import verifier_pb2_grpc as pb_grpc
from edge.tracing import REQUEST_SPAN, VERIFY_SPAN, Tracing, traced_channel
from edge.verifier.engine import Sampling, SessionInfo, VerifyResult
from edge.verifier.limits import DEVICE_KEY, retry_after_ms
from fedge.errors import FedgeError

T = TypeVar("T", bound=Message)
R = TypeVar("R")
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# FAILED_PRECONDITION while retrying: the retry raced its own first attempt, which is still running
RETRY_RACE = grpc.StatusCode.FAILED_PRECONDITION


class VerifierUnreachable(FedgeError):
    """The verifier answered UNAVAILABLE or DEADLINE_EXCEEDED (or not SERVING) for too long."""


@dataclass
class _EdgeSession:
    """What the edge knows of one of its sessions: enough to replay or reopen it anywhere."""

    wire_id: str  # the id on the verifier; a fresh one after ABORTED
    committed: list[int]  # prompt + every token the verifier has returned
    sampling: Sampling
    known: bool  # the verifier has (as far as we know) opened it


@dataclass(frozen=True)
class ClientConfig:
    """How the edge reaches the verifier."""

    target: str  # HOST:PORT
    token: str | None = None  # bearer token, when the verifier requires one
    root_cert: Path | None = None  # PEM root certificate; given = TLS
    tls_server_name: str | None = None  # override the name checked against the certificate
    timeout_s: float = 30.0  # per call
    added_rtt_s: float = 0.0  # simulated network round trip added to every call
    max_retries: int = 5  # on RESOURCE_EXHAUSTED
    backoff_s: float = 0.01  # first retry delay when the server names none; doubles each retry
    device_id: str | None = None  # sent as `fedge-device` metadata: the key of per-device limits
    max_wait_s: float = (
        2.0  # longest server-asked retry-after waited out; longer raises RateLimited
    )
    unreachable_after_s: float = 3.0  # UNAVAILABLE / DEADLINE_EXCEEDED retried this long
    health_timeout_s: float = 1.0  # a health check slower than this counts as down

    def __post_init__(self) -> None:
        host, _, port = self.target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"ClientConfig.target must be HOST:PORT, got {self.target!r}")
        for name in (
            "timeout_s",
            "added_rtt_s",
            "backoff_s",
            "max_wait_s",
            "unreachable_after_s",
            "health_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"ClientConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"ClientConfig.max_retries must be >= 0, got {self.max_retries}")


class RateLimited(Exception):
    """The verifier refused a call for this device's rate limit and asked for a longer wait than allowed."""

    def __init__(self, retry_after_s: float, details: str) -> None:
        super().__init__(f"rate limited for {retry_after_s:.3f} s: {details}")
        self.retry_after_s = retry_after_s


class VerifierClient:
    """Blocking Verifier client; also the `VerifierLink` the speculative decoder drives."""

    def __init__(self, config: ClientConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.config = config
        self.bytes_up = 0
        self.bytes_down = 0
        self.calls = 0
        self.rate_limited_waits = 0  # retries after a server-named retry-after
        self.overloads = 0  # RESOURCE_EXHAUSTED replies seen (the router reads them)
        self.retries = 0  # transient failures retried
        self.reopens = 0  # sessions reopened after NOT_FOUND or ABORTED
        self._limits: SessionInfo | None = None  # the verifier's, from the first open
        self._sessions: dict[str, _EdgeSession] = {}
        self._closing: set[Any] = set()  # fire-and-forget CloseSession calls still in flight
        self.tracing = Tracing(tracer_provider)
        metadata = [("authorization", f"Bearer {config.token}")] if config.token else []
        if config.device_id:
            metadata.append((DEVICE_KEY, config.device_id))
        self._metadata = tuple(metadata)
        # reconnect quickly after an outage (gRPC's default backoff grows to two minutes)
        options: list[tuple[str, Any]] = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if config.root_cert is not None:
            credentials = grpc.ssl_channel_credentials(config.root_cert.read_bytes())
            if config.tls_server_name:
                options.append(("grpc.ssl_target_name_override", config.tls_server_name))
            self._channel = grpc.secure_channel(config.target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(config.target, options=options)
        self._stub = pb_grpc.VerifierStub(traced_channel(self._channel, tracer_provider))
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close_channel(self) -> None:
        """Let fire-and-forget closes land (closing the channel would cancel them), then close it."""
        for call in list(self._closing):
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                call.result(timeout=self.config.timeout_s)
        self._channel.close()

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_channel()

    def _retry_delay(self, err: grpc.RpcError, attempt: int, backoff_s: float) -> float:
        """Seconds to wait before retrying `err`; re-raises what must not be retried."""
        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
            raise err
        self.overloads += 1
        asked_ms = retry_after_ms(err.trailing_metadata())  # type: ignore[attr-defined]
        if asked_ms is not None and asked_ms / 1e3 > self.config.max_wait_s:
            raise RateLimited(asked_ms / 1e3, err.details()) from err  # type: ignore[attr-defined]
        if attempt == self.config.max_retries:
            raise err
        if asked_ms is None:
            return backoff_s
        self.rate_limited_waits += 1
        return asked_ms / 1e3

    def _attempt(self, request: Message, rpc: Callable[[], R]) -> R:
        """Run `rpc` with the added RTT and byte counting, retrying RESOURCE_EXHAUSTED refusals."""
        backoff = self.config.backoff_s
        for attempt in range(self.config.max_retries + 1):
            if self.config.added_rtt_s:
                time.sleep(self.config.added_rtt_s)
            self.calls += 1
            self.bytes_up += request.ByteSize()
            try:
                return rpc()
            except grpc.RpcError as err:
                time.sleep(self._retry_delay(err, attempt, backoff))
                backoff *= 2
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _unary(self, method: Any, request: Message, reply_type: type[T]) -> T:
        """One unary call (see `_attempt`); counts the reply's bytes."""
        reply: T = self._attempt(
            request,
            lambda: method(request, timeout=self.config.timeout_s, metadata=self._metadata),
        )
        self.bytes_down += reply.ByteSize()
        return reply

    def open(self, prompt_ids: Sequence[int], sampling: Sampling | None = None) -> SessionInfo:
        """Start a session: a real OpenSession the first time, later opened by its first verify."""
        sampling = sampling or Sampling()
        if self._limits is None:
            info = self.open_remote(prompt_ids, sampling)
            self._limits = info
            self._sessions[info.session_id] = _EdgeSession(
                info.session_id, list(prompt_ids), sampling, known=True
            )
            return info
        local_id = uuid.uuid4().hex
        self._sessions[local_id] = _EdgeSession(local_id, list(prompt_ids), sampling, known=False)
        limits = self._limits
        return SessionInfo(
            local_id, limits.vocab_size, limits.max_draft, limits.max_context, limits.session_ttl_s
        )

    def open_remote(self, prompt_ids: Sequence[int], sampling: Sampling) -> SessionInfo:
        """OpenSession: the verifier prefills the prompt now and picks the id."""
        reply = self._unary(
            self._stub.OpenSession,
            pb.OpenSessionRequest(prompt_ids=list(prompt_ids), sampling=_sampling(sampling)),
            pb.OpenSessionReply,
        )
        return SessionInfo(
            reply.session_id,
            reply.vocab_size,
            reply.max_draft,
            reply.max_context,
            reply.session_ttl_s,
        )

    def verify(
        self,
        session_id: str,
        draft_ids: Sequence[int],
        draft_probs: Sequence[float] = (),
        draft_dists: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
    ) -> VerifyResult:
        """Send a draft; returns how many were accepted and the next token (retried, reopened)."""
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
                reply = self._unary(self._stub.Verify, request, pb.VerifyReply)
            else:
                reply = self._verify_session(session, request)
                session.known = True
                session.committed += [*draft_ids[: reply.accepted], reply.next_token]
            if span is not None:
                span.set_attribute("fedge.accepted_tokens", reply.accepted)
        return VerifyResult(reply.accepted, reply.next_token, reply.session_length)

    def _verify_session(self, session: _EdgeSession, request: pb.VerifyRequest) -> pb.VerifyReply:
        """Verify with the expected length; retry transient failures, reopen a lost session."""
        request.session_id = session.wire_id
        request.expected_length = len(session.committed)
        if not session.known:
            self._attach_committed(session, request)
        delay = self.config.backoff_s
        give_up = time.monotonic() + self.config.unreachable_after_s
        while True:
            try:
                return self._unary(self._stub.Verify, request, pb.VerifyReply)
            except grpc.RpcError as err:
                code = err.code()  # type: ignore[attr-defined]
                if code == grpc.StatusCode.NOT_FOUND and not request.committed_ids:
                    self._attach_committed(session, request)
                    continue
                if code == grpc.StatusCode.ABORTED:  # diverged: start over under a new id
                    session.wire_id = request.session_id = uuid.uuid4().hex
                    self._attach_committed(session, request)
                    continue
                if code not in (*TRANSIENT, RETRY_RACE):
                    raise
                if time.monotonic() > give_up:
                    raise VerifierUnreachable(
                        f"verifier at {self.config.target} answered {code.name} for "
                        f"{self.config.unreachable_after_s} s; decode on the device"
                    ) from err
                self.retries += 1
                time.sleep(delay)
                delay = min(2 * delay, 0.5)

    def _attach_committed(self, session: _EdgeSession, request: pb.VerifyRequest) -> None:
        """Make the request (re)open the session from the edge's committed tokens."""
        self.reopens += int(session.known)
        del request.committed_ids[:]
        request.committed_ids.extend(session.committed)
        request.sampling.CopyFrom(_sampling(session.sampling))

    def close(self, session_id: str) -> int:
        """Close a session without waiting (fire-and-forget); returns the tokens it held here."""
        session = self._sessions.pop(session_id, None)
        if session is not None and not session.known:
            return len(session.committed)  # the verifier never saw it
        request = pb.CloseSessionRequest(session_id=session.wire_id if session else session_id)
        self.calls += 1
        self.bytes_up += request.ByteSize()
        call = self._stub.CloseSession.future(
            request, timeout=self.config.timeout_s, metadata=self._metadata
        )
        self._closing.add(call)  # a dropped call object would cancel the RPC when collected
        call.add_done_callback(self._closing.discard)
        return len(session.committed) if session else 0

    def close_remote(self, session_id: str) -> int:
        """CloseSession, waiting for the reply: the tokens the verifier held."""
        self._sessions.pop(session_id, None)
        reply = self._unary(
            self._stub.CloseSession,
            pb.CloseSessionRequest(session_id=session_id),
            pb.CloseSessionReply,
        )
        return int(reply.session_length)

    def health(self) -> int:
        """The verifier's overall health status (a `HealthCheckResponse.ServingStatus` value)."""
        reply = self._health.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=self.config.health_timeout_s
        )
        return int(reply.status)

    def ping(self) -> float:
        """Seconds for one health check; VerifierUnreachable unless the verifier is SERVING."""
        if self.config.added_rtt_s:
            time.sleep(self.config.added_rtt_s)
        started = time.perf_counter()
        status = self.health()
        if status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)  # type: ignore[arg-type]
            raise VerifierUnreachable(f"verifier at {self.config.target} is {name}")
        return time.perf_counter() - started + self.config.added_rtt_s

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_token_id: int | None = None,
    ) -> Iterator[int]:
        """Cloud-only decoding: yields the target's tokens as the server streams them."""
        sampling = sampling or Sampling()
        request = pb.GenerateRequest(
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=_sampling(sampling),
            stop_token_id=stop_token_id,
        )

        def start() -> tuple[Iterator[pb.GenerateReply], pb.GenerateReply | None]:
            stream = self._stub.Generate(
                request, timeout=self.config.timeout_s, metadata=self._metadata
            )
            return stream, next(stream, None)  # a refusal (rate limit, overload) arrives here

        stream, first = self._attempt(request, start)
        for reply in itertools.chain([] if first is None else [first], stream):
            self.bytes_down += reply.ByteSize()
            yield int(reply.token_id)


def _sampling(sampling: Sampling) -> pb.Sampling:
    """The engine's Sampling as the proto message."""
    return pb.Sampling(temperature=sampling.temperature, seed=sampling.seed)


# ---------------------------------------------------------------------- edge client library
@dataclass
class RequestReport:
    """How one request was served: route, why, and its decoding figures."""

    route: str
    reason: str
    tokens: int = 0
    seconds: float = 0.0
    ttft_s: float = 0.0
    rounds: int = 0
    round_trips: int = 0
    drafted: int = 0
    acceptance: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    cloud_tokens: int = 0  # of `tokens`, those the verifier produced before it was lost
    finished_on_device: bool = False  # the verifier became unreachable mid-request


class EdgeClient:
    """The device side as a library: tokenizer, draft runtime, verifier link and offload router.

    `stream_text(prompt)` yields text pieces as tokens are accepted; each request's
    route comes from the router (or is forced), and its outcome feeds the router.
    A request the verifier rate-limits (`RateLimited`) before its first token is
    decoded on the device instead, and the cloud routes are skipped until the
    verifier's retry-after has passed.
    """

    def __init__(
        self,
        runtime: Any,
        tokenizer: Any,
        verifier: VerifierClient | None,
        decode: Any,
        router: Any | None = None,
        objective: Any | None = None,
        rtt_max_age_s: float = 5.0,  # a health-check ping is reused this long: it costs an RTT
    ) -> None:
        from edge.router import Objective, Router

        self.runtime = runtime
        self.tokenizer = tokenizer
        self.verifier = verifier
        self.decode = decode
        self.router = router or Router()
        self.objective = objective or Objective()
        self.rtt_max_age_s = rtt_max_age_s
        self.last: RequestReport | None = None
        self._rtt: tuple[float, float] | None = None  # (measured at, seconds)
        self._cloud_after = 0.0  # monotonic time before which the verifier asked us to stay away
        if verifier is None:
            self.router.verifier_down()

    def stream_ids(
        self, prompt_ids: Sequence[int], route: str | None = None
    ) -> Iterator[list[int]]:
        """Yield generated token chunks on the chosen (or forced) route, as one traced request."""
        tracing = self.verifier.tracing if self.verifier is not None else Tracing(None)
        return tracing.iterate(
            REQUEST_SPAN,
            self._stream_ids(prompt_ids, route),
            self._describe,
            prompt_tokens=len(prompt_ids),
        )

    def _describe(self, span: Any) -> None:
        """Put the request report on its span."""
        if self.last is not None:
            for key, value in vars(self.last).items():
                span.set_attribute(f"fedge.{key}", value)

    def _stream_ids(self, prompt_ids: Sequence[int], route: str | None) -> Iterator[list[int]]:
        """The request: route, decode, measure; falls back to the device when rate limited."""
        from edge.router import Route

        rtt = self.measure_rtt()
        decision = self.router.choose(self.objective)
        chosen = Route(route) if route else decision.route
        reason = "forced by caller" if route else decision.reason
        wait_s = self._cloud_after - time.monotonic()
        if chosen != Route.EDGE_ONLY and wait_s > 0:
            chosen, reason = Route.EDGE_ONLY, f"verifier rate limit: {wait_s:.2f} s left"
        if chosen != Route.EDGE_ONLY and self.verifier is not None and not self._rtt:
            chosen, reason = Route.EDGE_ONLY, "verifier down (health check): decoded on the device"
        produced: list[int] = []
        started = time.perf_counter()
        try:
            for chunk in self._decode(prompt_ids, chosen, reason, rtt):
                produced += chunk
                yield chunk
        except RateLimited as limited:
            if produced:
                raise  # part of the answer came from the cloud already: the caller decides
            self._cloud_after = time.monotonic() + limited.retry_after_s
            self.router.observe_overload()
            reason = f"verifier rate limit ({limited.retry_after_s:.2f} s): finished on the device"
            yield from self._decode(prompt_ids, Route.EDGE_ONLY, reason, rtt)
        except (VerifierUnreachable, grpc.RpcError) as lost:
            if isinstance(lost, grpc.RpcError) and lost.code() not in TRANSIENT:  # type: ignore[attr-defined]
                raise
            yield from self._finish_on_device(prompt_ids, produced, rtt, started, lost)

    def _finish_on_device(
        self,
        prompt_ids: Sequence[int],
        produced: list[int],
        rtt: float,
        started: float,
        lost: Exception,
    ) -> Iterator[list[int]]:
        """The verifier went away mid-request: decode the rest with the draft, and say so."""
        from edge.router import Route

        self._rtt = None  # the next request checks health again, and returns when SERVING
        self.router.verifier_down()
        stop = self.decode.stop_token_id
        remaining = self.decode.max_new_tokens - len(produced)
        why = getattr(lost, "code", lambda: None)() or type(lost).__name__
        reason = (
            f"verifier unreachable after {len(produced)} tokens ({why}): finished on the device"
        )
        if remaining > 0 and not (produced and produced[-1] == stop):
            rest = dataclasses.replace(self.decode, max_new_tokens=remaining)
            yield from self._decode([*prompt_ids, *produced], Route.EDGE_ONLY, reason, rtt, rest)
        report = self.last = self.last or RequestReport(Route.EDGE_ONLY.value, reason)
        report.reason, report.finished_on_device = reason, True
        report.tokens += len(produced)
        report.cloud_tokens = len(produced)
        report.seconds = time.perf_counter() - started

    def _decode(
        self, prompt_ids: Sequence[int], chosen: Any, reason: str, rtt: float, decode: Any = None
    ) -> Iterator[list[int]]:
        """Decode on one route (with `decode`, default the client's), filling `self.last`."""
        decode = decode or self.decode
        from edge.decoder import SpeculativeDecoder, edge_only
        from edge.router import Outcome, Route

        if chosen != Route.EDGE_ONLY and self.verifier is None:
            raise ValueError(f"route {chosen.value} needs a verifier; pass --verifier HOST:PORT")
        report = RequestReport(chosen.value, reason)
        self.last = report
        verifier = self.verifier  # not None on the two verifier routes (checked above)
        calls0, up0, down0, overloads0 = (
            (verifier.calls, verifier.bytes_up, verifier.bytes_down, verifier.overloads)
            if verifier
            else (0, 0, 0, 0)
        )
        started = time.perf_counter()
        drafted, cloud_s = 0, 0.0

        def tick(chunk: list[int]) -> list[int]:
            if not report.tokens:
                report.ttft_s = time.perf_counter() - started
            report.tokens += len(chunk)
            return chunk

        if chosen == Route.SPECULATIVE and verifier is not None:
            decoder = SpeculativeDecoder(self.runtime, verifier, decode, self.router.speculation)
            for chunk in decoder.stream(prompt_ids):
                yield tick(chunk)
            s = decoder.stats
            report.rounds, report.acceptance = s.rounds, s.acceptance
            drafted, cloud_s = s.drafted, s.verify_seconds
            report.drafted = drafted
        elif chosen == Route.CLOUD_ONLY and verifier is not None:
            sampling = Sampling(decode.temperature, decode.seed)
            for token in verifier.generate(
                prompt_ids, decode.max_new_tokens, sampling, decode.stop_token_id
            ):
                yield tick([token])
            report.rounds = report.tokens
        else:
            for token in edge_only(self.runtime, prompt_ids, decode):
                yield tick([token])
            drafted = report.drafted = report.tokens
        report.seconds = time.perf_counter() - started
        if verifier is not None:
            report.round_trips = verifier.calls - calls0
            report.bytes_up = verifier.bytes_up - up0
            report.bytes_down = verifier.bytes_down - down0
            if verifier.overloads > overloads0:
                self.router.observe_overload()
        if chosen == Route.CLOUD_ONLY:
            cloud_s = report.seconds
        self.router.observe(
            Outcome(
                chosen,
                report.tokens,
                report.seconds,
                report.ttft_s,
                passes=report.rounds,
                bytes=report.bytes_up + report.bytes_down,
                round_trips=report.round_trips,
                drafted=drafted,
                cloud_seconds=cloud_s,
                rtt_s=rtt,
            ),
            self.objective,
        )

    def stream_text(self, prompt: str, route: str | None = None) -> Iterator[str]:
        """Yield decoded text pieces as tokens arrive."""
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if not prompt_ids:
            raise ValueError("prompt encodes to no tokens; pass some text")
        generated: list[int] = []
        shown = ""
        for chunk in self.stream_ids(prompt_ids, route):
            generated.extend(chunk)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown) :]
                shown = text

    def measure_rtt(self, force: bool = False) -> float:
        """The round trip from a health check, reused for `rtt_max_age_s` unless `force` (call it
        on a network change); marks the verifier down when unreachable."""
        if self.verifier is None:
            return 0.0
        now = time.monotonic()
        if not force and self._rtt is not None and now - self._rtt[0] < self.rtt_max_age_s:
            return self._rtt[1]
        try:
            if self._rtt is None:
                self.verifier.ping()  # a fresh channel's first call also pays for the connection
            rtt = self.verifier.ping()
        except (grpc.RpcError, VerifierUnreachable):
            self._rtt = None
            self.router.verifier_down()
            return 0.0
        self._rtt = (now, rtt)
        self.router.observe_rtt(rtt)
        return rtt
