"""One gRPC channel to the verifier, with round-trip and byte accounting and overload retries.

`Transport` owns the channel, the call metadata (bearer token, `fedge-device`), the health
check and the counters every report reads: `calls` (request/response exchanges the edge
waited on: round trips, health checks and retries included), `one_way` (messages sent without
waiting for the reply, such as CloseSession), `bytes_up` / `bytes_down` (protobuf payload
bytes; HTTP/2 framing and headers excluded). It also keeps the duration of recent exchanges
(`recent_round_trip`), measured for free by the calls it makes anyway: the shortest of them is
the network's round trip. Each exchange is timed net of the server's own time, which the
verifier reports in `fedge-server-ms` (`fedge.edge.proto.timing`; every call, Verify
included): the router's model (`fedge.edge.router`, `fedge.edge.draftlen`) prices the
verifier's compute separately (a route's seconds per token, a verify call's cost beyond the
RTT), so the RTT it is told must be the network alone, not a Generate's or an OpenSession's
prompt prefill. A server that sends no such key (an older verifier) leaves the whole exchange
counted.
For experiments without a network emulator it can add a round-trip time: it sleeps
`added_rtt_s` before each call. RESOURCE_EXHAUSTED replies are retried: after the
server's `fedge-retry-after-ms` when it sends one (a per-device rate limit; beyond
`max_wait_s` the call raises `RateLimited` so the caller can take another route), else with
exponential backoff.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import TracerProvider

from fedge.edge.client.config import ClientConfig, RateLimited, VerifierUnreachable
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.proto.timing import server_seconds
from fedge.edge.tracing import Tracing, traced_channel
from fedge.edge.verifier.limits import DEVICE_KEY, retry_after_ms

T = TypeVar("T", bound=Message)
R = TypeVar("R")
# reconnect quickly after an outage (gRPC's default backoff grows to two minutes); a connection
# of its own per client, as each device has: gRPC otherwise shares one TCP connection among the
# channels of a process to one address, so simulated devices reached one pod behind a Service
RECONNECT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
)


class Transport:
    """The channel, its metadata and counters; unary calls with overload retries; health."""

    def __init__(self, config: ClientConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.config = config
        self.bytes_up = 0
        self.bytes_down = 0
        self.calls = 0  # request/response exchanges waited on (round trips), health checks included
        self.one_way = 0  # messages whose reply nobody waits for (fire-and-forget)
        self._durations: deque[tuple[float, float]] = deque(maxlen=64)  # (ended at, seconds)
        self.rate_limited_waits = 0  # retries after a server-named retry-after
        self.overloads = 0  # RESOURCE_EXHAUSTED replies seen (the router reads them)
        self._in_flight: set[Any] = set()  # fire-and-forget calls not yet answered
        self.tracing = Tracing(tracer_provider)
        token = config.bearer_token()
        metadata = [("authorization", f"Bearer {token}")] if token else []
        if config.device_id:
            metadata.append((DEVICE_KEY, config.device_id))
        self.metadata = tuple(metadata)
        self._channel = _channel(config)
        self.stub = pb_grpc.VerifierStub(traced_channel(self._channel, tracer_provider))
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close_channel(self) -> None:
        """Let fire-and-forget calls land (closing the channel would cancel them), then close it."""
        for call in list(self._in_flight):
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                call.result(timeout=self.config.timeout_s)
        self._channel.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_channel()

    def attempt(
        self,
        request: Message,
        rpc: Callable[[], R],
        server_s: Callable[[R], float | None] = lambda _: None,
    ) -> R:
        """Run `rpc` with the added RTT and byte counting, retrying RESOURCE_EXHAUSTED refusals;
        the exchange is timed net of `server_s(result)`, the server's own time when it said."""
        backoff = self.config.backoff_s
        for attempt in range(self.config.max_retries + 1):
            if self.config.added_rtt_s:
                time.sleep(self.config.added_rtt_s)
            self.calls += 1
            self.bytes_up += request.ByteSize()
            try:
                started = time.perf_counter()
                result = rpc()
                elapsed = time.perf_counter() - started
                self.observe_round_trip(max(0.0, elapsed - (server_s(result) or 0.0)))
                return result
            except grpc.RpcError as err:
                time.sleep(self._retry_delay(err, attempt, backoff))
                backoff *= 2
        raise AssertionError("unreachable: the last attempt returns or raises")

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

    def unary(self, method: Any, request: Message, reply_type: type[T]) -> T:
        """One unary call (see `attempt`), timed net of the server's reported time; counts the
        reply's bytes."""
        reply, _ = self.attempt(
            request,
            lambda: method.with_call(
                request, timeout=self.config.timeout_s, metadata=self.metadata
            ),
            lambda done: server_seconds(done[1].trailing_metadata(), done[1].initial_metadata()),
        )
        self.bytes_down += reply.ByteSize()
        return reply  # type: ignore[no-any-return]

    def observe_round_trip(self, seconds: float) -> None:
        """One exchange took `seconds` of network from request to (first) reply (the server's
        reported time already taken out)."""
        self._durations.append((time.monotonic(), seconds + self.config.added_rtt_s))

    def recent_round_trip(self, max_age_s: float) -> float | None:
        """The shortest exchange of the last `max_age_s` seconds; None when there was none."""
        since = time.monotonic() - max_age_s
        recent = [seconds for at, seconds in self._durations if at >= since]
        return min(recent) if recent else None

    def forget_round_trips(self) -> None:
        """Drop the recorded durations (the network changed)."""
        self._durations.clear()

    def send(self, method: Any, request: Message) -> grpc.Future:
        """A call whose reply nobody waits for: it costs bytes, not a round trip (`one_way`).
        Returns the call, for a caller that wants to know how it ended."""
        self.one_way += 1
        self.bytes_up += request.ByteSize()
        call = method.future(request, timeout=self.config.timeout_s, metadata=self.metadata)
        self._in_flight.add(call)  # a dropped call object would cancel the RPC when collected
        call.add_done_callback(self._in_flight.discard)
        return call

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
        self.calls += 1
        started = time.perf_counter()
        status = self.health()
        if status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)  # type: ignore[arg-type]
            raise VerifierUnreachable(f"verifier at {self.config.target} is {name}")
        seconds = time.perf_counter() - started
        self.observe_round_trip(seconds)
        return seconds + self.config.added_rtt_s


def _channel(config: ClientConfig) -> grpc.Channel:
    """A plain or TLS channel to `config.target`, reconnecting quickly after an outage."""
    options = list(RECONNECT_OPTIONS)
    if config.root_cert is None:
        return grpc.insecure_channel(config.target, options=options)
    credentials = grpc.ssl_channel_credentials(
        config.root_cert.read_bytes(),
        private_key=config.client_key.read_bytes() if config.client_key else None,
        certificate_chain=config.client_cert.read_bytes() if config.client_cert else None,
    )
    if config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    return grpc.secure_channel(config.target, credentials, options=options)
