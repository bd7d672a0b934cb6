"""gRPC ingress of the verifier fleet: the `fedge.edge.v1.Verifier` service in front of Ray Serve replicas.

The ingress is a Ray Serve deployment (one or several replicas sharing one port)
that binds a grpc.aio server
speaking the same proto as a single verifier, plus the standard health service,
so an edge client cannot tell a fleet from one process. Its handlers are generic:
built from the proto's service descriptor, they parse each request only for
routing hints (session id, tokens), relay its bytes to a replica through a
deployment handle (whose request router is the load-balancing policy), and
relay the reply or status back.

State: the ingress keeps none of its own. The routing (stable and canary
applications, the split, the limits, the promoted fleet config), each session's
home, the token buckets and the canary's figures live in the fleet's shared state
(`fedge.edge.fleet.state`: Redis when configured), read and written by every ingress
replica (`fedge.edge.fleet.ingress_state`), so an ingress can die without losing them.

Sessions: the state remembers which application and replica opened each
session and the ingress hints that replica to the router (session affinity). A session whose
replica died or was retired lands on another replica, which answers NOT_FOUND,
and the edge reopens it from its committed tokens (the proto's recovery path).
A Generate stream cut by a replica's death resumes on another replica from the
prompt plus the tokens already streamed, so the caller sees no error. Like a single
verifier, each answer says how long the fleet worked on it (`fedge-server-ms`: from the
call's arrival here to its reply, the relay and the replica's compute included), so the
edge's round-trip estimate is the network to the ingress alone. A session
that moves (a spill, or a drained home) is closed on its old replica when that
one is alive, fire-and-forget, so its KV cache is freed at once rather than at
its time-to-live.

Canary: new sessions go to a canary application with a set probability; every
ingress records per-application figures (acceptance, errors, latency) into the
state, which the rollout controller (fedge.edge.fleet.rollout) compares.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedge.edge.fleet.ingress_spec import SERVICE_NAME, IngressSpec, SwitchableLimits
from fedge.edge.fleet.ingress_state import IngressState
from fedge.edge.fleet.relay import (
    BUSY,
    GONE,
    Admission,
    caller_identity,
    failure_kind,
    failure_result,
    relay_metadata,
    routing_tokens,
    session_key,
    session_of,
)
from fedge.edge.fleet.routers import ROUTE_MOVE_TOKENS, ROUTE_REPLICA, ROUTE_SESSION, ROUTE_TOKENS
from fedge.edge.fleet.state import Routing, open_state
from fedge.edge.fleet.stats import CallOutcome, ReplicaFigures
from fedge.edge.fleet.wire import ROUTE_PIN, CallResult, Metadata
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto.streams import reply_tokens, resume_generate
from fedge.edge.proto.timing import server_ms_metadata
from fedge.edge.tracing import server_interceptors, shutdown, tracer_provider
from fedge.edge.verifier.auth import CALLER
from fedge.edge.verifier.limits import RateLimitConfig

LOG = logging.getLogger("fedge.fleet")
REPLICA_DEPLOYMENT = "verifier"
RESUMABLE_STREAM = "Generate"  # prompt_ids + max_new_tokens in, token ids out (reply_tokens)
RESUME_ATTEMPTS = 3
CLOSE_TIMEOUT_S = 10.0  # a moved session's CloseSession on its old replica
CLOSE_WAIT_S = 1.0  # how long a NOT_FOUND waits for that close (a reopen may land there)


class FleetIngress:
    """Ray Serve deployment class: the fleet's gRPC front door (one or several replicas)."""

    async def __init__(self, spec: IngressSpec) -> None:  # type: ignore[misc]
        self.spec = spec
        self.key = spec.key()  # checks sealed configs, signs the identities relayed to replicas
        self.store = open_state(
            spec.redis_url,
            spec.redis_password_file,
            spec.rate_limits.max_devices,
            session_ttl_s=spec.session_ttl_s,
            max_sessions_per_owner=spec.max_sessions_per_owner,
        )
        declared = Routing(spec.stable_app, limits=spec.rate_limits)
        self.state = IngressState(self.store, declared, spec.fleet, spec.epoch, key=self.key)
        routing = await self.state.start()  # a restart adopts the stored routing, limits included
        self.replicas: dict[str, ReplicaFigures] = {}
        self.resumed_streams = 0
        self.moved_sessions = 0  # sessions closed on the replica they moved away from
        self._closing: set[asyncio.Task[Any]] = set()
        self._handles: dict[str, Any] = {}
        self.health = health.aio.HealthServicer()
        self.admission = Admission(spec.max_inflight)
        self.limits = SwitchableLimits(routing.limits, self.store.buckets)
        self.state.on_limits = self.limits.configure
        self.tracer_provider = tracer_provider(spec.tracing)
        authenticator = spec.authenticator()  # first: a stranger is traced, charged, relayed never
        interceptors = [] if authenticator is None else [authenticator]
        interceptors += [*server_interceptors(self.tracer_provider), self.limits]
        limits = [
            ("grpc.max_receive_message_length", spec.max_message_bytes),
            ("grpc.max_send_message_length", spec.max_message_bytes),
            ("grpc.so_reuseport", int(spec.share_port)),
        ]
        self.server = grpc.aio.server(interceptors=interceptors, options=limits)
        self.server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._port = spec.bind(self.server)
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        LOG.info("fleet ingress on %s:%d -> %s", spec.host, self._port, routing.stable)

    # ------------------------------------------------------------------ admin (deployment methods)
    def port(self) -> int:
        """The bound gRPC port."""
        return self._port

    async def describe(self) -> dict[str, Any]:
        """Current applications and traffic split (the fleet's, whichever ingress answers)."""
        return await self.state.describe()

    async def set_canary(self, app: str | None, fraction: float = 0.0) -> None:
        """Send `fraction` of new sessions to application `app` (None: no canary)."""
        await self.state.set_canary(app, fraction)

    async def set_rate_limits(self, config: RateLimitConfig) -> None:
        """Replace the fleet's per-device limits (an empty config turns them off)."""
        await self.state.set_rate_limits(config)

    async def fleet_config(self) -> bytes:
        """The sealed FleetConfig of the stable version (for the rollout controller)."""
        return await self.state.fleet_config()

    async def promote(self, app: str, fleet: bytes) -> None:
        """Make `app` (serving the sealed FleetConfig `fleet`) the stable application."""
        await self.state.promote(app, fleet)

    async def arm_stats(self) -> dict[str, dict[str, float]]:
        """Figures per application since the canary was set (from every ingress)."""
        return await self.state.arm_stats()

    async def reset_arm_stats(self) -> None:
        """Start both arms' figures from zero now (after the canary's warm-up)."""
        await self.state.reset_arm_stats()

    async def rollout(self) -> dict[str, Any] | None:
        """The progress of the rollout under way (None: none)."""
        return await self.state.rollout()

    async def set_rollout(self, progress: dict[str, Any] | None) -> None:
        """Record a rollout's progress in the fleet's state."""
        await self.state.set_rollout(progress)

    async def fleet_stats(self) -> dict[str, Any]:
        """Open sessions per replica (fleet-wide), and this ingress's per-replica figures,
        Generate streams resumed elsewhere and sessions moved; `ingress` tells the ingresses
        apart (its process id), since each keeps its own figures."""
        return {
            "ingress": os.getpid(),
            "sessions": await self.store.sessions_per_replica(),
            "replicas": {replica: figures.summary() for replica, figures in self.replicas.items()},
            "resumed_streams": self.resumed_streams,
            "moved_sessions": self.moved_sessions,
        }

    def reset_stats(self) -> int:
        """Forget this ingress's per-replica figures (e.g. after a warm-up); returns its
        process id, as `fleet_stats` names it."""
        self.replicas.clear()
        self.resumed_streams = 0
        return os.getpid()

    async def __del__(self) -> None:
        """Stop answering when Serve retires the ingress; flush its spans."""
        await self.server.stop(1.0)
        await self.store.close()
        shutdown(self.tracer_provider)

    # ------------------------------------------------------------------ routing
    def _handle(self, app: str) -> Any:
        """The (cached) deployment handle of `app`'s replicas: one router per application."""
        from ray import serve

        handle = self._handles.get(app)
        if handle is None:
            handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=app)
            self._handles = {a: h for a, h in self._handles.items() if self.state.routing.live(a)}
            self._handles[app] = handle
        return handle

    def _handlers(self) -> grpc.GenericRpcHandler:
        """One generic handler per method of the Verifier service descriptor."""
        service = pb.DESCRIPTOR.services_by_name["Verifier"]
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method in service.methods:
            request_cls = message_factory.GetMessageClass(method.input_type)
            reply_cls = message_factory.GetMessageClass(method.output_type)
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    self._stream_handler(method.name, reply_cls),
                    request_deserializer=request_cls.FromString,
                    response_serializer=reply_cls.SerializeToString,
                )
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary_handler(method.name, reply_cls),
                    request_deserializer=request_cls.FromString,
                    response_serializer=reply_cls.SerializeToString,
                )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def _unary_handler(self, name: str, reply_cls: type[Message]) -> Any:
        """The relay of one unary method."""

        async def handle(request: Message, context: grpc.aio.ServicerContext) -> Message:
            with self.admission.admit() as refused:
                if refused is not None:
                    await context.abort(
                        grpc.StatusCode[refused.code], refused.details, refused.trailing
                    )
                return await relay(request, context)

        async def relay(request: Message, context: grpc.aio.ServicerContext) -> Message:
            started = time.perf_counter()
            session_id = session_of(request)
            owner = caller_identity(context.invocation_metadata() or ())
            version = str(getattr(request, "version", ""))
            app, home = await self.state.target(session_id, owner, version)
            result = await self._relay_unary(name, request, context, app, home)
            self._count(name, request, result.replica, started, 0)
            if home and result.replica and result.replica != home:  # the session moved
                closing = self._close_moved(app, home, session_id, context)
                if result.code == "NOT_FOUND":  # the edge reopens next: close before, or the
                    await asyncio.wait({closing}, timeout=CLOSE_WAIT_S)  # reopen may be closed
            if result.code == "OK":
                reply = reply_cls.FromString(result.payload)
                sid = session_id or session_of(reply)
                await self.state.remember(name, sid, app, result, owner, home)
                await self.state.learn_version(reply, app)
                await self._observe(app, name, request, reply, result.code, started)
                # the edge times the network to here: the relay and the replica are the server's
                context.set_trailing_metadata(server_ms_metadata(started))
                return reply
            await self.state.remember(name, session_id, app, result, owner, home)
            await self._observe(app, name, request, None, result.code, started)
            await context.abort(grpc.StatusCode[result.code], result.details, result.trailing)
            raise AssertionError("grpc.aio context.abort returned instead of raising")

        return handle

    async def _relay_unary(
        self,
        name: str,
        request: Message,
        context: grpc.aio.ServicerContext,
        app: str,
        home: str,
    ) -> CallResult:
        """Send one unary call to a replica of `app`; a replica death becomes a status, never a crash.

        A call not bound to a live session (OpenSession, a Verify that opens its session)
        holds no state yet, so it is retried once on another replica when one died; a
        session's call whose replica died ends NOT_FOUND (the edge reopens from its
        committed tokens). Full queues end RESOURCE_EXHAUSTED with a retry-after, any other
        failure UNAVAILABLE (`fedge.edge.fleet.relay`).
        """
        session_id = session_of(request)
        owner = caller_identity(context.invocation_metadata() or ())
        opening = not home  # no session on a live replica yet: it may open anywhere
        attempts = 2 if opening else 1
        for attempt in range(attempts):
            try:
                return await (  # type: ignore[no-any-return]
                    self._handle(app)
                    .unary.options()
                    .remote(
                        name,
                        request.SerializeToString(),
                        relay_metadata(
                            context.invocation_metadata() or (), self.key, name, session_id
                        ),
                        context.time_remaining(),
                        **{
                            ROUTE_TOKENS: routing_tokens(request),
                            ROUTE_REPLICA: home,
                            ROUTE_MOVE_TOKENS: int(getattr(request, "expected_length", 0)),
                            ROUTE_SESSION: session_key(owner, session_id),
                        },
                    )
                )
            except Exception as error:  # the relay failed: a replica died, queues full, a bug
                kind = failure_kind(error)
                LOG.warning(
                    "%s on %s failed (%s, attempt %d): %r", name, app, kind, attempt + 1, error
                )
                if not opening or kind != GONE:
                    return failure_result(kind, session_id)
        return CallResult("UNAVAILABLE", "no verifier replica could take the call; retry shortly")

    def _close_moved(
        self, app: str, replica: str, session_id: str, context: grpc.aio.ServicerContext
    ) -> asyncio.Task[None]:
        """Close `session_id` on the replica it left, fire-and-forget (NOT_FOUND there if gone).

        The call is pinned to that replica (`ROUTE_PIN`), draining or not; when it is
        gone, whichever replica gets the call refuses it, so the session's new copy is
        never touched. It carries the caller's metadata: sessions are scoped by token.
        """
        payload = pb.CloseSessionRequest(session_id=session_id).SerializeToString()
        metadata = relay_metadata(
            context.invocation_metadata() or (), self.key, "CloseSession", session_id
        )
        owner = caller_identity(context.invocation_metadata() or ())
        pinned = {
            ROUTE_PIN: replica,
            ROUTE_TOKENS: 1,
            ROUTE_REPLICA: "",
            ROUTE_SESSION: session_key(owner, session_id),
        }

        async def close() -> None:
            try:
                result = await self._handle(app).unary.remote(
                    "CloseSession", payload, metadata, CLOSE_TIMEOUT_S, **pinned
                )
            except Exception as error:  # the old replica died meanwhile: nothing to free
                LOG.debug("closing moved session %s on %s: %s", session_id, replica, error)
                return
            self.moved_sessions += result.code == "OK"

        task = asyncio.ensure_future(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    def _stream_handler(self, name: str, reply_cls: type[Message]) -> Any:
        """The relay of one server-streaming method."""

        async def handle(
            request: Message, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Message]:
            with self.admission.admit() as refused:
                if refused is not None:
                    await context.abort(
                        grpc.StatusCode[refused.code], refused.details, refused.trailing
                    )
                async for reply in relay(request, context):
                    yield reply

        async def relay(
            request: Message, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Message]:
            started = time.perf_counter()
            app, _ = await self.state.target("")
            code, details, trailing = "OK", "", Metadata()
            replica, streamed = "", 0
            async for result in self._relay_stream(name, request, context, app):
                replica = result.replica or replica
                if result.code != "OK":
                    code, details, trailing = result.code, result.details, result.trailing
                    break
                reply = reply_cls.FromString(result.payload)
                if not streamed:  # the edge times the network to here (`fedge.edge.proto.timing`)
                    await context.send_initial_metadata(server_ms_metadata(started))
                streamed += len(reply_tokens(reply)) if isinstance(reply, pb.GenerateReply) else 1
                yield reply
            self._count(name, request, replica, started, streamed)
            await self._observe(app, name, request, None, code, started)
            if code != "OK":
                await context.abort(grpc.StatusCode[code], details, trailing)

        return handle

    async def _relay_stream(
        self, name: str, request: Message, context: grpc.aio.ServicerContext, app: str
    ) -> AsyncIterator[CallResult]:
        """Relay a stream; a Generate cut by a replica's death resumes from the tokens streamed."""
        current = request
        for attempt in range(RESUME_ATTEMPTS):
            streamed: list[int] = []
            try:
                responses = (
                    self._handle(app)
                    .options(stream=True)
                    .stream.remote(
                        name,
                        current.SerializeToString(),
                        relay_metadata(
                            context.invocation_metadata() or (),
                            self.key,
                            name,
                            session_of(current),
                        ),
                        context.time_remaining(),
                        **{ROUTE_TOKENS: routing_tokens(current), ROUTE_REPLICA: ""},
                    )
                )
                async for result in responses:
                    if result.code == "OK" and name == RESUMABLE_STREAM:
                        streamed.extend(reply_tokens(pb.GenerateReply.FromString(result.payload)))
                    yield result
                return
            except Exception as error:  # the replica died mid-stream, or queues are full
                kind = failure_kind(error)
                LOG.warning(
                    "%s stream on %s cut (%s, attempt %d): %r", name, app, kind, attempt + 1, error
                )
                if kind == BUSY:
                    yield failure_result(kind, "")
                    return
                if not isinstance(current, pb.GenerateRequest):
                    break
                resumed = resume_generate(current, streamed)
                if resumed is None:  # nothing left to generate
                    return
                current = resumed
                self.resumed_streams += 1
        yield CallResult("UNAVAILABLE", "the verifier replica serving this stream went away")

    def _count(
        self, method: str, request: Message, replica: str, started: float, streamed: int
    ) -> None:
        """Feed the per-replica figures (calls that reached no replica are not counted)."""
        if not replica:
            return
        figures = self.replicas.setdefault(replica, ReplicaFigures())
        opened = method == "OpenSession" or len(getattr(request, "committed_ids", ())) > 0
        elapsed = time.perf_counter() - started
        figures.record(method, elapsed, routing_tokens(request), opened, streamed)

    async def _observe(
        self,
        app: str,
        method: str,
        request: Message,
        reply: Message | None,
        code: str,
        started: float,
    ) -> None:
        """Feed the application's canary figures (while a canary runs)."""
        call = CallOutcome(
            method,
            code,
            seconds=time.perf_counter() - started,
            drafted=len(getattr(request, "draft_ids", ())),
            accepted=int(getattr(reply, "accepted", 0)) if reply is not None else 0,
            session_id=session_of(request),
            owner=CALLER.get() or "",  # authenticated only: an open ingress's tokens are anyone's
        )
        await self.state.observe(app, call)
