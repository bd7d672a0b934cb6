"""One verifier replica of the fleet: a Ray Serve deployment around the single-process verifier.

Each replica runs the ordinary verifier (`fedge.edge.verifier.server`: engine, servicer,
health, auth) on a loopback port of its own and relays the ingress's calls to it
as serialized protobuf bytes. The replica therefore speaks exactly the protocol
the single process speaks, whatever that protocol grows into, and the ingress
never needs to know the verifier's internals. Failures come back as values
(`CallResult`), so gRPC status codes cross Ray unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedge.edge.fleet.relay import check_identity, session_of
from fedge.edge.fleet.sealed import load_key
from fedge.edge.fleet.speed import ReplicaSpeed
from fedge.edge.fleet.wire import (
    ROUTE_PIN,
    ROUTE_TOKENS,
    SERVING,
    SPEEDS,
    CallResult,
    Metadata,
    ReplicaStopping,
    clean_metadata,
)
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.tracing import TracingConfig, tracer_provider
from fedge.edge.verifier.auth import AUTH_HEADER
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import (
    SERVICE_NAME,
    BackgroundServer,
    ServerConfig,
    load_verifier_model,
)

LOG = logging.getLogger("fedge.fleet")
SERVICE_PATH = "/fedge.edge.v1.Verifier/"
REPLICA_SERVICE = "fedge-verifier-replica"  # service.name of a replica's spans


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica of one deployment serves: base model, adapter, engine limits."""

    model_dir: Path
    adapter_dir: Path | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    slowdown: float = 1.0  # bench: the rank-0 replica answers every call (and every streamed
    # reply) this many times as late as it would, like a replica on a slower machine
    tracing: TracingConfig = field(
        default_factory=lambda: TracingConfig(service_name=REPLICA_SERVICE)
    )
    # the fleet key: a relayed call's identity must carry the ingress's signature under it
    # (`fedge.edge.fleet.relay.check_identity`); None: identities are taken as named
    fleet_key_file: Path | None = None

    def __post_init__(self) -> None:
        if not 1.0 <= self.slowdown <= 100.0:
            raise ValueError(f"ReplicaSpec.slowdown must lie in [1, 100], got {self.slowdown}")

    def code_version(self) -> str:
        """A name for what replicas of this spec run, the same for an equal spec: Serve keeps
        running replicas across a redeploy under an unchanged version (only rescaling them)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


async def _held_back(started: float, slowdown: float) -> None:
    """Wait until `slowdown` times the time since `started` has passed (1.0: no wait).

    The whole call is scaled, not the forward pass alone: on the micro models a forward
    takes 1-2 ms of a call's ~80 ms (the relay, gRPC and the engine's bookkeeping), so a
    slower forward hardly slowed the replica, whereas a real model's call is mostly its
    forward. The wait is a sleep: the slowed replica is late, it takes no CPU from the others.
    """
    if slowdown > 1.0:
        await asyncio.sleep((slowdown - 1.0) * (time.perf_counter() - started))


class VerifierReplica:
    """Ray Serve deployment class: loads the model once, serves it through a private verifier."""

    def __init__(self, spec: ReplicaSpec, replica_id: str = "", rank: int = 0) -> None:
        """Load the model and start the private verifier.

        `replica_id` and `rank` are Serve's (read from the replica context) unless an id is
        given: outside Serve (the Ray-free tests) the caller names the replica.
        """
        if not replica_id:
            from ray import serve

            context = serve.get_replica_context()
            replica_id, rank = context.replica_id.unique_id, context.rank.rank
        self.replica_id = replica_id
        model = load_verifier_model(spec.model_dir, spec.adapter_dir)
        self.slowdown = spec.slowdown if rank == 0 else 1.0
        # the private verifier answers only this replica's relay, which names the caller the
        # ingress authenticated; the secret is made here and never leaves the process
        self._relay_secret = secrets.token_hex(32)
        self._relay_auth = (AUTH_HEADER, f"Bearer {self._relay_secret}")
        config = ServerConfig(
            spec.model_dir,
            spec.adapter_dir,
            engine=spec.engine,
            relay_secret=self._relay_secret,
            drain_notice_s=0.0,
            grace_s=1.0,
        )
        self._server: BackgroundServer | None = BackgroundServer(
            config, model, tracer_provider(spec.tracing)
        )
        self.port = self._server.start()  # type: ignore[union-attr]
        self._channel: grpc.aio.Channel | None = None
        self._stopping = False  # Serve is stopping this replica: its verifier refuses new calls
        self._held = False  # drained on purpose and kept: the health check still passes
        self.speed = ReplicaSpeed()  # this replica's own speed, behind every ingress's calls
        # the fleet key: the identity of a relayed call must be the one the ingress signed
        self._key = load_key(spec.fleet_key_file) if spec.fleet_key_file is not None else None
        self._health_stub = health_pb2_grpc.HealthStub(
            grpc.insecure_channel(f"127.0.0.1:{self.port}")
        )
        LOG.info("replica %s serving on 127.0.0.1:%d", self.replica_id, self.port)

    def _open_channel(self) -> grpc.aio.Channel:
        """The loopback channel to this replica's verifier (made on the replica's event loop)."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        return self._channel

    def _fail(self, error: grpc.aio.AioRpcError) -> CallResult:
        """A relayed gRPC error as a value; raises when this replica is stopping.

        A call that reached the replica after Serve began stopping it finds its verifier
        closed (UNAVAILABLE). Raised, the ingress treats it as the replica's loss: a call
        that opens its session is retried elsewhere, a session's call ends NOT_FOUND and
        the edge reopens the session, a Generate resumes elsewhere.
        """
        if self._stopping:
            raise ReplicaStopping(f"replica {self.replica_id} is stopping")
        trailing = clean_metadata(tuple(error.trailing_metadata() or ()))
        return CallResult(error.code().name, error.details() or "", b"", self.replica_id, trailing)

    def _pinned_elsewhere(self, hints: dict[str, object]) -> str:
        """The replica a call is pinned to when that is not this one (it is gone), else ""."""
        pin = str(hints.get(ROUTE_PIN) or "")
        return pin if pin and pin != self.replica_id else ""

    def _refuses(self, hints: dict[str, object]) -> CallResult | None:
        """NOT_FOUND for a call pinned to another replica (its pinned replica is gone)."""
        pin = self._pinned_elsewhere(hints)
        if pin:
            return CallResult("NOT_FOUND", f"replica {pin} is gone", b"", self.replica_id)
        if self._stopping:
            raise ReplicaStopping(f"replica {self.replica_id} is stopping")
        return None

    def _unsigned(self, method: str, payload: bytes, metadata: Metadata) -> CallResult | None:
        """UNAUTHENTICATED when the call's identity is not the one the ingress signed for this
        method and session (a process reaching the replica through Ray, not the ingress)."""
        if self._key is None:
            return None
        try:
            request_cls = message_factory.GetMessageClass(
                pb.DESCRIPTOR.services_by_name["Verifier"].methods_by_name[method].input_type
            )
            session_id = session_of(request_cls.FromString(payload))
        except (KeyError, DecodeError):
            return CallResult("INVALID_ARGUMENT", f"no Verifier call {method!r} with that payload")
        problem = check_identity(self._key, metadata, method, session_id)
        if problem is None:
            return None
        LOG.warning("replica %s refused a relayed %s: %s", self.replica_id, method, problem)
        return CallResult("UNAUTHENTICATED", problem, b"", self.replica_id)

    def _vouch(self, metadata: Metadata) -> Metadata:
        """The relayed metadata (with the ingress's `fedge-identity`) plus this replica's secret."""
        return (*((k, v) for k, v in metadata if k != AUTH_HEADER), self._relay_auth)

    async def unary(
        self,
        method: str,
        payload: bytes,
        metadata: Metadata = (),
        timeout_s: float | None = None,
        **hints: object,
    ) -> CallResult:
        """Relay one unary Verifier call (`method` is its short name, e.g. "Verify")."""
        refused = self._refuses(hints) or self._unsigned(method, payload, metadata)
        if refused is not None:
            return refused
        call = self._open_channel().unary_unary(SERVICE_PATH + method)
        started = time.perf_counter()
        tokens = int(hints.get(ROUTE_TOKENS) or 1)  # type: ignore[call-overload]
        ticket = self.speed.begin(method, tokens)
        try:
            reply = await call(payload, metadata=self._vouch(metadata), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            return self._fail(error)
        finally:  # answered, failed or cancelled: the verifier is done with it
            self.speed.leave(ticket)
        await _held_back(started, self.slowdown)
        self.speed.served(ticket)
        return CallResult("OK", "", reply, self.replica_id)

    async def stream(
        self,
        method: str,
        payload: bytes,
        metadata: Metadata = (),
        timeout_s: float | None = None,
        **hints: object,
    ) -> AsyncIterator[CallResult]:
        """Relay one server-streaming call; a failure is the last item, with its code."""
        refused = self._refuses(hints) or self._unsigned(method, payload, metadata)
        if refused is not None:
            yield refused
            return
        call = self._open_channel().unary_stream(SERVICE_PATH + method)
        started = time.perf_counter()
        try:
            async for reply in call(payload, metadata=self._vouch(metadata), timeout=timeout_s):
                await _held_back(started, self.slowdown)
                yield CallResult("OK", "", reply, self.replica_id)
                started = time.perf_counter()
        except grpc.aio.AioRpcError as error:
            yield self._fail(error)

    def _serving(self) -> bool:
        """Whether the private verifier reports SERVING over gRPC.

        A blocking channel of its own: Serve may call this from another event loop than
        the relays', and a grpc.aio channel must stay on the loop that made it.
        """
        reply = self._health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def check_health(self) -> None:
        """Ray Serve's health probe: failing it, the replica is replaced (unless held)."""
        if not self._held and not self._serving():
            raise RuntimeError(f"verifier of replica {self.replica_id} is not SERVING")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the fleet's routers read of this replica (Serve polls it): whether it serves,
        and its speed per kind of call (`ReplicaSpeed.report`).

        A replica that reports NOT_SERVING gets no new calls from the moment its
        routers see this, before Serve's health check has replaced it. The speed is
        measured here, behind the calls of every ingress; a router sees only its own.
        """
        return {SERVING: self._serving(), SPEEDS: self.speed.report()}

    def set_serving(self, serving: bool, retire: bool = True, **hints: object) -> str:
        """Report SERVING or NOT_SERVING (drain); returns this replica's id.

        NOT_SERVING stops the routers sending calls here; with `retire` Serve's health
        check then fails and Serve replaces the replica, without it the replica is held
        (drained, kept) until `set_serving(True)`. Pin the call to a replica with the
        `ROUTE_PIN` keyword (`Fleet.call_replica`).
        """
        pin = self._pinned_elsewhere(hints)
        if pin:
            raise LookupError(f"replica {pin} is gone; nothing was drained")
        self._held = not serving and not retire
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        server = self._server.server if self._server is not None else None
        if server is not None:
            for name in ("", SERVICE_NAME):
                self._server.submit(server.health.set(name, status)).result()  # type: ignore[union-attr]
        return self.replica_id

    def open_sessions(self, **hints: object) -> int:
        """Sessions this replica's verifier holds (KV caches in memory)."""
        pin = self._pinned_elsewhere(hints)
        if pin:
            raise LookupError(f"replica {pin} is gone")
        server = self._server.server if self._server is not None else None
        engine = server.engine if server is not None else None
        return len(engine.sessions) if engine is not None else 0

    def speed_report(self, **hints: object) -> dict[str, tuple[float, float]]:
        """This replica's own seconds per work token per kind of call, each with the standard
        error of its logarithm (`ReplicaSpeed.report_with_noise`): its speed behind every call
        in flight here, whatever share of the load it got, and how far its calls spread."""
        pin = self._pinned_elsewhere(hints)
        if pin:
            raise LookupError(f"replica {pin} is gone")
        return {kind: (s.seconds, s.log_se) for kind, s in self.speed.report_with_noise().items()}

    def slowed_by(self, **hints: object) -> float:
        """How many times as late this replica answers (bench: the slowed one; else 1.0)."""
        pin = self._pinned_elsewhere(hints)
        if pin:
            raise LookupError(f"replica {pin} is gone")
        return self.slowdown

    def __del__(self) -> None:
        """Stop the private verifier when Serve stops the replica (after Serve's own drain)."""
        self._stopping = True
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop(grace_s=1.0)
            self._server = None
