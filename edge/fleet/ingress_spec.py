"""The fleet ingress's settings: where it listens, who may call (credentials, TLS), its limits.

Secrets are named by path and read when the ingress starts (`authenticator`, `bind`),
so none is pickled into the deployment's arguments. Kept apart from the ingress so
that the KubeRay builders and the CLI can build a spec without grpc.aio servers.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from fedge.edge.fleet.redis_state import check_redis_url
from fedge.edge.tracing import TracingConfig
from fedge.edge.verifier.auth import Authenticator, Credentials, server_credentials
from fedge.edge.verifier.limits import RateLimitConfig, RateLimiter, RateLimitInterceptor

SERVICE_NAME = (
    "fedge.edge.v1.Verifier"  # = fedge.edge.verifier.server.SERVICE_NAME (no torch import)
)
INGRESS_SERVICE = "fedge-fleet-ingress"  # service.name of the ingress's spans


class SwitchableLimits(grpc.aio.ServerInterceptor):
    """The fleet's per-device rate limits, replaceable while the ingress serves (None: off).

    Every call of the fleet passes an ingress, and every ingress charges the same
    buckets (`shared(kind, rate, burst)`: the fleet state's), so the buckets bound a
    device across all replicas and ingresses (limits in each would allow N times the
    rate).
    """

    def __init__(self, config: RateLimitConfig, shared: Callable[[str, float, int], Any]) -> None:
        self.current: RateLimitInterceptor | None = None
        self._shared = shared
        self.configure(config)

    def configure(self, config: RateLimitConfig) -> None:
        """Charge the shared buckets at `config`'s rates (limits off when it limits nothing)."""
        self.config = config
        limiter = RateLimiter(config, shared=self._shared) if config.enabled else None
        self.current = None if limiter is None else RateLimitInterceptor(limiter, SERVICE_NAME)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        current = self.current
        if current is None:
            return await continuation(handler_call_details)
        return await current.intercept_service(continuation, handler_call_details)


@dataclass(frozen=True)
class IngressSpec:
    """Where the ingress listens, which replica application serves at start, who may call, limits.

    Secrets are named by path and read when the ingress starts, so none is pickled
    into the deployment's arguments.
    """

    stable_app: str
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port; `port()` tells which
    credentials_file: Path | None = None  # 'IDENTITY TOKEN' per device line; None = open
    tls_cert: Path | None = None  # PEM chain; with tls_key every call is over TLS
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # PEM CA of client certificates (mTLS)
    max_message_bytes: int = 4 << 20  # largest request (= the single verifier's)
    max_inflight: int = 4096  # calls held at once; beyond, RESOURCE_EXHAUSTED at once
    fleet: bytes = b""  # the sealed FleetConfig (`fedge.edge.fleet.sealed`; opaque here)
    fleet_key_file: Path | None = None  # the fleet key: checks sealed configs, signs identities
    session_ttl_s: float = (
        24 * 3600.0
    )  # a session's home is forgotten this long after its last call
    max_sessions_per_owner: int = 1024  # session homes kept per owner (least recently called go)
    redis_url: str | None = None  # the fleet's shared state; None: in the (single) ingress
    redis_password_file: Path | None = None  # the Redis password, read at start
    # names this deployment of the ingress: its first replica writes the declared routing,
    # a restarted or second replica adopts the stored one (promotions and canaries survive)
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    rate_limits: RateLimitConfig = field(default_factory=RateLimitConfig)  # per device, fleet-wide
    tracing: TracingConfig = field(
        default_factory=lambda: TracingConfig(service_name=INGRESS_SERVICE)
    )
    # several ingress replicas on one node listen on `port` together (SO_REUSEPORT); alone the
    # bind is exclusive, so a port another process holds fails instead of splitting the calls
    share_port: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"IngressSpec.port must lie in [0, 65535], got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("IngressSpec.tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("IngressSpec.tls_client_ca needs tls_cert and tls_key")
        if self.max_inflight < 1:
            raise ValueError(f"IngressSpec.max_inflight must be >= 1, got {self.max_inflight}")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        elif self.redis_password_file is not None:
            raise ValueError("IngressSpec.redis_password_file needs redis_url")
        if self.session_ttl_s <= 0:
            raise ValueError(f"IngressSpec.session_ttl_s must be > 0, got {self.session_ttl_s}")

    def key(self) -> bytes | None:
        """The fleet key, read from its file now (None without one)."""
        if self.fleet_key_file is None:
            return None
        from fedge.edge.fleet.sealed import load_key

        return load_key(self.fleet_key_file)

    def authenticator(self) -> Authenticator | None:
        """The interceptor naming each caller, reading the credentials file now (None: open)."""
        credentials = (
            Credentials.load(self.credentials_file) if self.credentials_file is not None else None
        )
        if credentials is None and self.tls_client_ca is None:
            return None
        return Authenticator(credentials, certificates=self.tls_client_ca is not None)

    def bind(self, server: grpc.aio.Server) -> int:
        """Add the listening port (TLS when configured); returns it."""
        address = f"{self.host}:{self.port}"
        if self.tls_cert is not None and self.tls_key is not None:
            credentials = server_credentials(self.tls_cert, self.tls_key, self.tls_client_ca)
            bind = partial(server.add_secure_port, address, credentials)
        else:
            bind = partial(server.add_insecure_port, address)
        try:
            port = bind()
        except RuntimeError:  # gRPC's "Failed to bind": the port is held (or the host unknown)
            port = 0
        if port == 0:
            raise OSError(
                f"cannot bind the fleet ingress to {address} (in use?); pick another port"
            )
        return port
