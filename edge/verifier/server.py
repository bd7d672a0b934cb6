"""Verifier server lifecycle: build it, load the model, serve, drain on shutdown.

`create_server(cfg)` binds a grpc.aio server with the Verifier service and the
standard `grpc.health.v1` service (NOT_SERVING while the model loads and while
draining), starts it, loads the base model and optional LoRA adapter, then flips
health to SERVING. `serve(cfg)` runs one until SIGINT/SIGTERM. `BackgroundServer`
runs one on its own event loop thread, for tests, the demo and benchmarks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import TracerProvider
from prometheus_client import start_http_server
from transformers import PreTrainedModel

from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.tracing import Tracing, server_interceptors
from fedge.edge.verifier.auth import Authenticator, Credentials, server_credentials, token_identity
from fedge.edge.verifier.engine import EngineConfig, VerifierEngine
from fedge.edge.verifier.identity import serving_identity
from fedge.edge.verifier.limits import RateLimitConfig, RateLimiter, RateLimitInterceptor
from fedge.edge.verifier.metrics import VerifierMetrics
from fedge.edge.verifier.service import VerifierService

T = TypeVar("T")
LOG = logging.getLogger("fedge.verifier")
SERVICE_NAME = "fedge.edge.v1.Verifier"
# the port is this server's alone: gRPC's default (SO_REUSEPORT) lets a second process bind
# the same port and take part of the connections, another model's answers included
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
EXIT_ENGINE_DIED = 3  # `serve` exits with this when the engine's worker dies, for a supervisor


@dataclass(frozen=True)
class ServerConfig:
    """Where the verifier listens, what it serves, and how it guards access."""

    model_dir: Path
    adapter_dir: Path | None = None  # peft LoRA adapter, merged into the base at load
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port; create_server returns the bound one
    engine: EngineConfig = field(default_factory=EngineConfig)
    token: str | None = None  # a bearer token every Verifier call may carry (one shared identity)
    tokens: tuple[str, ...] = ()  # more accepted tokens, each its own identity
    credentials_file: Path | None = None  # 'IDENTITY TOKEN' per device line, read at start
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key enables TLS
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # PEM CA: clients must show a certificate it signed (mTLS)
    relay_secret: str | None = None  # a fleet replica's: its relay names the caller's identity
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None = off, 0 = any
    health_port: int | None = None  # plaintext grpc.health.v1 only (kubelet probes cannot TLS)
    drain_notice_s: float = 1.0  # NOT_SERVING but still serving, so health checkers move traffic
    grace_s: float = 5.0  # then in-flight calls get this long to finish; new ones are refused
    rate_limits: RateLimitConfig = field(
        default_factory=RateLimitConfig
    )  # per device; off by default
    max_message_bytes: int = 4 << 20  # largest request; a full sampling draft is ~16 x 32 x 8 B

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"ServerConfig.tls_cert and tls_key must be given together, got "
                f"tls_cert={self.tls_cert} tls_key={self.tls_key}"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "ServerConfig.tls_client_ca needs tls_cert and tls_key (mTLS runs over TLS)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port must lie in [0, 65535], got {self.port}")
        if any(not t.strip() for t in self.accepted_tokens):
            raise ValueError(
                "ServerConfig.token/tokens must not be blank; omit them to disable auth"
            )
        if self.max_message_bytes < 1024:
            raise ValueError(
                f"ServerConfig.max_message_bytes must be >= 1024, got {self.max_message_bytes}"
            )
        for name in ("grace_s", "drain_notice_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ServerConfig.{name} must be >= 0, got {getattr(self, name)}")
        self.rate_limits.check_covers_verify(self.engine.max_draft, "ServerConfig")

    @property
    def accepted_tokens(self) -> tuple[str, ...]:
        """The bearer tokens given inline (each its own identity, `token:<digest>`)."""
        return ((self.token,) if self.token is not None else ()) + self.tokens

    def authenticator(self) -> Authenticator | None:
        """The interceptor that names every caller, reading the credentials file now (None: open)."""
        inline = {token: token_identity(token) for token in self.accepted_tokens}
        credentials = None
        if self.credentials_file is not None:
            credentials = Credentials.load(self.credentials_file)
            credentials = Credentials.merged(credentials, Credentials.inline(inline))
        elif inline:
            credentials = Credentials.inline(inline)
        certificates = self.tls_client_ca is not None
        if credentials is None and not certificates and self.relay_secret is None:
            return None
        return Authenticator(credentials, certificates, self.relay_secret)


def load_verifier_model(model_dir: Path, adapter_dir: Path | None = None) -> PreTrainedModel:
    """Load the base causal LM and, when given, merge a peft LoRA adapter into its weights."""
    from fedge.models import load_causal_lm

    model = load_causal_lm(model_dir)
    if adapter_dir is None:
        return model
    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{adapter_dir} has no adapter_config.json; pass the directory a federated run saved "
            "with save_pretrained (peft format)"
        )
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return merged.eval()  # type: ignore[no-any-return,operator]


class VerifierServer:
    """A bound, started grpc.aio server plus its engine, health servicer and metrics.

    Interceptors, outermost first: authentication (when credentials, client
    certificates or a relay secret are set), so that nothing runs for a stranger;
    tracing (when a tracer provider is given); per-identity rate limits (when a
    rate is set).
    """

    def __init__(self, config: ServerConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.config = config
        self.metrics = VerifierMetrics()
        self.engine: VerifierEngine | None = None
        self.health = health.aio.HealthServicer()
        self.tracing = Tracing(tracer_provider)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        authenticator = config.authenticator()
        self._authenticated = authenticator is not None
        if authenticator is not None:
            interceptors.append(authenticator)
        interceptors += server_interceptors(tracer_provider)
        self.limiter: RateLimiter | None = None  # the per-device buckets, when any kind is metered
        if config.rate_limits.enabled:
            self.limiter = RateLimiter(config.rate_limits)
            interceptors.append(RateLimitInterceptor(self.limiter, SERVICE_NAME))
        limits = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            EXCLUSIVE_PORT,
        ]
        self.grpc = grpc.aio.server(interceptors=interceptors, options=limits)
        self.health_grpc: grpc.aio.Server | None = None  # the plaintext health-only listener
        self.health_port: int | None = None
        pb_grpc.add_VerifierServicer_to_server(
            VerifierService(lambda: self.engine, self.metrics), self.grpc
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_http: object | None = None
        self.engine_died: asyncio.Event | None = (
            None  # set (on the server's loop) if the worker dies
        )
        self._health_task: asyncio.Future[None] | None = None
        self._stopped = False

    def _bind(self) -> int:
        """Bind the configured address (TLS when configured); returns the port."""
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert is not None and self.config.tls_key is not None:
            credentials = server_credentials(
                self.config.tls_cert, self.config.tls_key, self.config.tls_client_ca
            )
            bind = partial(self.grpc.add_secure_port, address, credentials)
        else:
            bind = partial(self.grpc.add_insecure_port, address)
        try:
            port = bind()
        except RuntimeError:  # gRPC's "Failed to bind": the port is held (or the host unknown)
            port = 0
        if port == 0:
            raise OSError(f"cannot bind the verifier to {address} (in use?); pick another port")
        return port

    async def _set_health(
        self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None:
        """Report the same status for the Verifier service and the server as a whole."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def listen(self) -> int:
        """Bind and start answering: health NOT_SERVING, Verifier calls UNAVAILABLE until `load`."""
        self.port = self._bind()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        if self.config.health_port is not None:
            self.health_grpc = grpc.aio.server(options=[EXCLUSIVE_PORT])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_grpc)
            address = f"{self.config.host}:{self.config.health_port}"
            try:
                self.health_port = self.health_grpc.add_insecure_port(address)
            except RuntimeError:  # gRPC's "Failed to bind"
                self.health_port = 0
            if self.health_port == 0:
                raise OSError(f"cannot bind the verifier's health port to {address}")
            await self.health_grpc.start()
        if self.config.metrics_port is not None:
            http, _ = start_http_server(
                self.config.metrics_port, addr=self.config.host, registry=self.metrics.registry
            )
            self._metrics_http = http
            self.metrics_port = int(http.server_port)
        return self.port

    async def load(self, model: PreTrainedModel | None = None) -> None:
        """Load the model (unless given), start the engine, report SERVING."""
        if model is None:
            model = await asyncio.to_thread(
                load_verifier_model, self.config.model_dir, self.config.adapter_dir
            )
        loop = asyncio.get_running_loop()
        self.engine_died = asyncio.Event()
        # the model, torch and transformers are a heap of long-lived objects: keep the cyclic
        # collector from rescanning them (a full pass stalled a stream ~0.3 s on the micro zoo)
        gc.collect()
        gc.freeze()
        identity = await asyncio.to_thread(
            serving_identity, self.config.model_dir, self.config.adapter_dir
        )
        # off the loop: an ONNX runtime may export the target first (minutes for a real model)
        engine = await asyncio.to_thread(
            VerifierEngine,
            model,
            self.config.engine,
            observer=self.metrics,
            tracing=self.tracing,
            identity=identity,
        )
        engine.on_death(lambda error: _call_soon(loop, self._engine_dead))
        self.metrics.watch(engine)
        # start() spawns the ring workers when sharding is on: off the loop, health stays answerable
        self.engine = await asyncio.to_thread(engine.start)
        log_shares(self.config, authenticator_set=self._authenticated)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        LOG.info("verifier serving %s on %s:%d", self.config.model_dir, self.config.host, self.port)

    def _engine_dead(self) -> None:
        """On the loop: report NOT_SERVING for good and wake whoever waits in `serve`."""
        if self.engine_died is not None:
            self.engine_died.set()
        self._health_task = asyncio.ensure_future(
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        )

    async def wait(self, stopping: asyncio.Event) -> int:
        """Until `stopping` is set or the engine dies; drains, then returns the exit status."""
        died = self.engine_died or asyncio.Event()
        waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(died.wait())]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if died.is_set():
            LOG.critical("engine worker died; stopping with exit status %d", EXIT_ENGINE_DIED)
            await self.stop(grace_s=0.0)
            return EXIT_ENGINE_DIED
        LOG.info("draining for up to %.1f s", self.config.grace_s)
        await self.stop()
        return 0

    async def start(self, model: PreTrainedModel | None = None) -> int:
        """`listen` then `load`; returns the port."""
        port = await self.listen()
        await self.load(model)
        return port

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: NOT_SERVING for `drain_notice_s` (calls still served), then a grace period, then stop."""
        if self._stopped:
            return
        self._stopped = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(self.config.drain_notice_s)
        await self.grpc.stop(self.config.grace_s if grace_s is None else grace_s)
        if self.health_grpc is not None:
            await self.health_grpc.stop(0)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()  # type: ignore[attr-defined]
            self._metrics_http = None


def log_shares(config: ServerConfig, authenticator_set: bool) -> None:
    """Say at start which per-device guarantees hold and which need an option."""
    engine, limits = config.engine, config.rate_limits
    quota = engine.sessions_per_owner
    LOG.info(
        "fair shares per device: sessions %s of %d, KV %d MiB shared max-min among devices "
        "holding sessions%s, steps shared by owner; generate %s tok/s, prefill %s tok/s, "
        "verify %s",
        f"<= {quota}" if quota else "unlimited (quota off)",
        engine.max_sessions,
        engine.kv_cap_bytes >> 20,
        f" (<= {engine.kv_cap_per_token_bytes} bytes each)"
        if engine.kv_cap_per_token_bytes
        else "",
        "unmetered" if limits.generate_rate is None else f"{limits.generate_rate:g}",
        "unmetered" if limits.prefill_rate is None else f"{limits.prefill_rate:g}",
        "unmetered" if limits.verify_rate is None else f"{limits.verify_rate:g} tok/s",
    )
    if not authenticator_set:
        LOG.warning(
            "no --credentials/--token: callers are not told apart, so per-device shares, "
            "quotas and rate limits key on what callers assert; set credentials to enforce them"
        )
    if not quota:
        LOG.warning("per-device session quota off: one device may hold the session table")


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Schedule `callback` on `loop` from another thread (nothing if the loop is closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


async def create_server(
    config: ServerConfig,
    model: PreTrainedModel | None = None,
    tracer_provider: TracerProvider | None = None,
) -> tuple[VerifierServer, int]:
    """Build, bind and start a verifier; returns it and its port. `model` skips loading from disk."""
    server = VerifierServer(config, tracer_provider)
    port = await server.start(model)
    return server, port


def serve(
    config: ServerConfig,
    on_ready: Callable[[int], None] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """Run a verifier until SIGINT or SIGTERM, then drain for `config.grace_s` and exit.

    If the engine's worker dies, health turns NOT_SERVING and the process exits with
    EXIT_ENGINE_DIED so that a supervisor restarts it.
    """

    async def main() -> int:
        server, port = await create_server(config, tracer_provider=tracer_provider)
        if on_ready is not None:
            on_ready(port)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        return await server.wait(stopping)

    status = asyncio.run(main())
    if status:
        raise SystemExit(status)


class BackgroundServer:
    """A verifier on its own event-loop thread: `start()` returns the port, `stop()` drains it."""

    def __init__(
        self,
        config: ServerConfig,
        model: PreTrainedModel | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.config = config
        self._model = model
        self._tracer_provider = tracer_provider
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="verifier-loop", daemon=True
        )
        self.server: VerifierServer | None = None
        self.port = 0

    def start(self) -> int:
        """Start the loop thread and the server on it; blocks until it serves."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            create_server(self.config, self._model, self._tracer_provider), self._loop
        )
        self.server, self.port = future.result()
        return self.port

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` on the server's loop (e.g. `server.wait(...)`); returns its future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def stop(self, grace_s: float = 0.5) -> None:
        """Drain and stop the server, then the loop thread."""
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self._loop).result()
            self.server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        with contextlib.suppress(RuntimeError):
            self._loop.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
