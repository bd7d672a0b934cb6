"""Deploy the verifier fleet on Ray Serve: replica applications, the gRPC ingress, their lifecycle.

Layout on Serve: the ingress is one application (`fedge-ingress`); each model
version (base + adapter) is an application of its own (`fedge-v<N>`) holding
the `verifier` deployment of N replicas, whose request router is the chosen
load-balancing policy. A canary is one more such application; promotion points
the ingress at it and deletes the old one, rollback deletes the canary.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedge.edge.fleet.ingress import REPLICA_DEPLOYMENT, FleetIngress
from fedge.edge.fleet.ingress_spec import INGRESS_SERVICE, IngressSpec
from fedge.edge.fleet.ingress_state import FLEET_KIND  # the sealed FleetConfig's kind
from fedge.edge.fleet.replica import REPLICA_SERVICE, ReplicaSpec, VerifierReplica
from fedge.edge.fleet.routers import policy_class, policy_path
from fedge.edge.fleet.sealed import KEY_FILE, from_json, load_key, seal, to_json, unseal, write_key
from fedge.edge.fleet.wire import ROUTE_PIN
from fedge.edge.tracing import TracingConfig
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.limits import RateLimitConfig
from fedge.ports import free_port

LOG = logging.getLogger("fedge.fleet")
INGRESS_APP = "fedge-ingress"
VERSION_PREFIX = "fedge-v"
NAMESPACE = "fedge"
SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"


@dataclass(frozen=True)
class FleetConfig:
    """The fleet: what it serves, how many replicas, how it balances, heals and scales."""

    model_dir: Path
    adapter_dir: Path | None = None
    replicas: int = 2  # fixed count; with max_replicas set, the autoscaler's starting count
    policy: str = "token-aware"
    affinity: bool = True  # a session's calls go to the replica holding its KV cache
    host: str = "127.0.0.1"
    port: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    credentials_file: Path | None = None  # 'IDENTITY TOKEN' per device; the ingress reads it
    tls_cert: Path | None = None  # PEM chain and key of the ingress's TLS listener
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # PEM CA of client certificates (mTLS)
    redis_url: str | None = None  # the shared state of the ingresses (routing, sessions, buckets)
    redis_password_file: Path | None = None  # its password, read by each ingress at start
    ingress_replicas: int = 1  # ingresses on one port; more than one needs redis_url
    min_replicas: int = 1  # autoscaling lower bound (used when max_replicas is set)
    max_replicas: int | None = None  # None = no autoscaling
    target_queue: float = 8.0  # autoscaling target: ongoing calls per replica
    upscale_delay_s: float = 2.0  # queue depth above target this long adds replicas
    downscale_delay_s: float = 30.0  # below target this long removes them (not at every lull)
    scaling_window_s: float = 30.0  # Serve averages the queue depth over this window
    scaling_metrics_s: float = 10.0  # how often the ingress's handle reports its queue to Serve
    # (Serve 2.55's `metrics_interval_s`, deprecated there in favour of an environment variable)
    max_ongoing_requests: int = 64  # per replica; above it Serve queues in the ingress
    max_queued_requests: int = 256  # queued in the ingress's handle per version; beyond it a
    # call is refused RESOURCE_EXHAUSTED with a retry-after (Serve's BackPressureError)
    max_inflight: int = 4096  # calls the ingress holds at once; beyond, refused at once
    health_period_s: float = 2.0  # Serve probes each replica's verifier health this often
    health_timeout_s: float = 10.0
    replica_cpus: float = 1.0  # logical CPUs each replica reserves in Ray
    slowdown: float = 1.0  # bench: the rank-0 replica answers this many times as late
    rate_limits: RateLimitConfig = field(default_factory=RateLimitConfig)  # per device, fleet-wide
    tracing: TracingConfig = field(default_factory=TracingConfig)  # ingress and replicas
    # the fleet key (hex, mode 0600): seals the config in the shared state and signs the
    # identity the ingress relays to the replicas; None: `start_fleet` writes a fresh one
    fleet_key_file: Path | None = None
    # start Ray with token authentication (a process without the token cannot join, read the
    # ingress's admin methods or call a replica); off only when told (`--no-ray-auth`)
    ray_auth: bool = True

    def __post_init__(self) -> None:
        policy_class(self.policy)
        if self.replicas < 1:
            raise ValueError(f"FleetConfig.replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None and not (
            1 <= self.min_replicas <= self.replicas <= self.max_replicas
        ):
            raise ValueError(
                "FleetConfig needs 1 <= min_replicas <= replicas <= max_replicas, got "
                f"{self.min_replicas}, {self.replicas}, {self.max_replicas}"
            )
        for name in (
            "target_queue",
            "health_period_s",
            "health_timeout_s",
            "scaling_window_s",
            "scaling_metrics_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"FleetConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.scaling_window_s <= self.scaling_metrics_s:
            raise ValueError(
                "FleetConfig.scaling_window_s must exceed scaling_metrics_s (Serve averages "
                f"reports over the window), got {self.scaling_window_s} <= {self.scaling_metrics_s}"
            )
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"FleetConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_queued_requests", "max_inflight", "max_ongoing_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"FleetConfig.{name} must be >= 1, got {getattr(self, name)}")
        self.rate_limits.check_covers_verify(self.engine.max_draft, "FleetConfig")
        if self.ingress_replicas < 1:
            raise ValueError(
                f"FleetConfig.ingress_replicas must be >= 1, got {self.ingress_replicas}"
            )
        if self.ingress_replicas > 1 and self.redis_url is None:
            raise ValueError(
                f"FleetConfig.ingress_replicas={self.ingress_replicas} needs redis_url: "
                "ingresses share their routing, sessions and buckets through Redis"
            )
        if self.replica_cpus < 0:
            raise ValueError(f"FleetConfig.replica_cpus must be >= 0, got {self.replica_cpus}")

    def key(self) -> bytes:
        """The fleet key, read from `fleet_key_file`."""
        if self.fleet_key_file is None:
            raise ValueError("FleetConfig.fleet_key_file is not set (start_fleet writes one)")
        return load_key(self.fleet_key_file)

    def seal(self, key: bytes) -> bytes:
        """This config as the shared state keeps it: typed JSON under the fleet key's MAC."""
        return seal(FLEET_KIND, to_json(self), key)

    @classmethod
    def unseal(cls, blob: bytes, key: bytes) -> FleetConfig:
        """The config in sealed value `blob`; `SealError` when it was not sealed with `key`."""
        return from_json(cls, unseal(FLEET_KIND, blob, key))

    def sessions_per_owner(self) -> int:
        """Session homes the shared state keeps per owner: the per-device quota on every
        replica the fleet may run (1024 without a quota)."""
        quota = self.engine.sessions_per_owner  # the quota in force (16 when none was set)
        return quota * (self.max_replicas or self.replicas) if quota > 0 else 1024

    def replica_spec(self, adapter_dir: Path | None = None) -> ReplicaSpec:
        """What each replica of a version serves (`adapter_dir` overrides the fleet's)."""
        return ReplicaSpec(
            self.model_dir,
            adapter_dir or self.adapter_dir,
            self.engine,
            self.slowdown,
            replace(self.tracing, service_name=REPLICA_SERVICE),
            fleet_key_file=self.fleet_key_file,
        )

    def ingress_spec(self, stable_app: str, port: int | None = None) -> IngressSpec:
        """The ingress in front of `stable_app`: address, shared state, limits, tracing; the
        config goes sealed (`seal`), the key by its file's path."""
        return IngressSpec(
            stable_app,
            self.host,
            self.port if port is None else port,
            self.credentials_file,
            self.tls_cert,
            self.tls_key,
            self.tls_client_ca,
            max_inflight=self.max_inflight,
            fleet=self.seal(self.key()),
            fleet_key_file=self.fleet_key_file,
            session_ttl_s=self.engine.session_ttl_s,
            max_sessions_per_owner=self.sessions_per_owner(),
            redis_url=self.redis_url,
            redis_password_file=self.redis_password_file,
            rate_limits=self.rate_limits,
            tracing=replace(self.tracing, service_name=INGRESS_SERVICE),
            share_port=self.ingress_replicas > 1,
        )

    def autoscaling(self) -> dict[str, Any] | None:
        """Ray Serve autoscaling config on queue depth, or None for a fixed count."""
        if self.max_replicas is None:
            return None
        return {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_queue,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.scaling_window_s,
            "metrics_interval_s": self.scaling_metrics_s,
        }


def replica_application(
    config: FleetConfig, adapter_dir: Path | None = None, code_version: str | None = None
) -> Any:
    """The `verifier` deployment of one model version, bound and ready for `serve.run`.

    `code_version` (default: the replica spec's, `ReplicaSpec.code_version`) names what the
    replicas run: `serve.run` of an application under the version it runs only reconfigures
    it (running replicas, their sessions and warm caches stay; a promoted canary grows around
    its replica, a new autoscaling range reloads no model); another version replaces every
    replica one at a time (`restart_version`).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    scaling = config.autoscaling()
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_queued_requests,
        "health_check_period_s": config.health_period_s,
        "health_check_timeout_s": config.health_timeout_s,
        "graceful_shutdown_timeout_s": 5.0,
        "ray_actor_options": {"num_cpus": config.replica_cpus},
        "request_router_config": RequestRouterConfig(
            request_router_class=policy_path(config.policy),  # type: ignore[arg-type]
            request_router_kwargs={"affinity": config.affinity},
            request_routing_stats_period_s=config.health_period_s,  # type: ignore[arg-type]
        ),
    }
    spec = config.replica_spec(adapter_dir)
    options["version"] = code_version or spec.code_version()
    if scaling is None:
        options["num_replicas"] = config.replicas
    else:
        options["autoscaling_config"] = scaling
    return serve.deployment(**options)(VerifierReplica).bind(spec)


RAY_TOKEN_FILE = "ray-auth-token"


def enable_ray_token(directory: Path) -> Path | None:
    """Turn on Ray's token authentication for the cluster this process starts: RAY_AUTH_MODE=token
    and, unless a token is configured already (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH), a fresh one
    in `directory` (mode 0600), where Ray's processes and `fedge verifier rollout` read it.
    Leaves an explicit RAY_AUTH_MODE alone. Returns the token file (None: not written here)."""
    if os.environ.get("RAY_AUTH_MODE", "token") != "token":
        LOG.warning("RAY_AUTH_MODE=%s: Ray runs without token auth", os.environ["RAY_AUTH_MODE"])
        return None
    os.environ["RAY_AUTH_MODE"] = "token"
    path = None
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        import secrets

        path = directory / RAY_TOKEN_FILE
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")  # Ray read its config at import: read RAY_AUTH_MODE again
    AuthenticationTokenLoader.instance().reset_cache()
    return path


RAY_START_ATTEMPTS = 3
RAY_NODE_MARKER = "FEDGE_FLEET_RAY_NODE"  # inherited by the processes of one start attempt


def _init_ray() -> None:
    """`ray.init` of a local node, started again (up to RAY_START_ATTEMPTS) when its raylet
    overran Ray's fixed 30 s start-up window on a loaded machine ("The current node timed out
    during startup"): the failed attempt's processes, which carry that attempt's marker in
    their environment, are stopped by pid first (Ray no longer tracks them)."""
    import uuid

    import psutil
    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        marker = uuid.uuid4().hex
        os.environ[RAY_NODE_MARKER] = marker
        try:
            ray.init(
                namespace=NAMESPACE,
                include_dashboard=False,
                log_to_driver=False,
                num_cpus=max(2, os.cpu_count() or 2),
            )
            return
        except Exception as err:
            if "timed out during startup" not in str(err) or attempt == RAY_START_ATTEMPTS:
                raise
            LOG.warning("Ray start attempt %d timed out; starting it again", attempt)
            ray.shutdown()
            leftovers = []
            for proc in psutil.process_iter(["pid"]):
                try:
                    if proc.pid != os.getpid() and proc.environ().get(RAY_NODE_MARKER) == marker:
                        leftovers.append(proc)
                except psutil.Error:
                    continue
            for proc in leftovers:
                try:
                    proc.kill()
                except psutil.Error:
                    continue
            psutil.wait_procs(leftovers, timeout=10)
        finally:
            os.environ.pop(RAY_NODE_MARKER, None)


def ensure_serve(auth_dir: Path | None = None) -> bool:
    """Start Ray (local, no dashboard; with token auth when `auth_dir` is given: `enable_ray_token`)
    and Serve (no HTTP proxy) unless running; True if started."""
    import ray
    from ray import serve

    started = False
    if not ray.is_initialized():
        if auth_dir is not None and "RAY_ADDRESS" not in os.environ:
            enable_ray_token(auth_dir)
        _init_ray()
        started = True
    serve.start(proxy_location="Disabled")
    return started


def version_app(version: int) -> str:
    """Application name of model version `version`."""
    return f"{VERSION_PREFIX}{version}"


@dataclass
class Fleet:
    """A running fleet: the ingress port and handle, the stable version."""

    config: FleetConfig
    port: int
    ingress: Any
    owns_ray: bool = False

    def describe(self) -> dict[str, Any]:
        """The ingress's current stable and canary applications."""
        return dict(self.ingress.describe.remote().result())

    def replica_actors(self, app: str | None = None) -> dict[str, str]:
        """Replica id -> Ray actor name of every live replica of `app` (default: the stable one)."""
        return replica_actors(app or self.describe()["stable"])

    def call_replica(self, replica_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` of one replica of the stable version (pinned; NOT_SERVING or not)."""
        from ray import serve

        handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=self.describe()["stable"])
        return getattr(handle, method).remote(*args, **{ROUTE_PIN: replica_id, **kwargs}).result()

    def stored_config(self) -> FleetConfig:
        """The stable version's config as the shared state holds it (its seal checked)."""
        return stored_config(self.ingress, self.config.key())

    def promote(self, app: str, config: FleetConfig) -> None:
        """Make `app`, serving `config`, the stable application (the config sealed)."""
        self.ingress.promote.remote(app, config.seal(self.config.key())).result()

    def restart(self) -> dict[str, Any]:
        """Replace every replica of the stable version in place, one at a time (`restart_version`)."""
        report = restart_version(self.ingress, self.config.key())
        self.config = self.stored_config()
        return report

    def stop(self) -> None:
        """Delete the fleet's applications; shut Ray down if this fleet started it."""
        import ray
        from ray import serve

        for app in list(serve.status().applications):
            if app == INGRESS_APP or app.startswith(VERSION_PREFIX):
                serve.delete(app)
        if self.owns_ray:
            serve.shutdown()
            ray.shutdown()


def replica_actors(app: str) -> dict[str, str]:
    """Replica id -> actor name of the live `verifier` replicas of `app` (Serve names them
    `SERVE_REPLICA::<app>#<deployment>#<replica id>` in the `serve` namespace)."""
    import ray

    prefix = f"{SERVE_REPLICA_PREFIX}{app}#{REPLICA_DEPLOYMENT}#"
    return {
        actor["name"][len(prefix) :]: actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(prefix)
    }


def stored_config(ingress: Any, key: bytes) -> FleetConfig:
    """The stable version's FleetConfig from the ingress, unsealed with the fleet key (a value
    not sealed with it is refused: `SealError`)."""
    return FleetConfig.unseal(ingress.fleet_config.remote().result(), key)


def restart_version(ingress: Any, key: bytes, timeout_s: float = 600.0) -> dict[str, Any]:
    """Replace every replica of the ingress's stable version, one at a time, failing no call.

    This is Ray Serve's rolling update: `serve.run` under a new code version (the spec's
    with a restart suffix), so Serve stops old replicas 20% of the target count at a time (at least
    one: one at a time below 10 replicas) and stops the next only once a new replica
    runs in its place. A stopping replica leaves its routers at once and finishes the
    calls it holds (`graceful_shutdown_timeout_s`); a call that still reaches it is
    handled as the replica's loss (`ReplicaStopping`), and its sessions reopen on
    another replica from the edge's committed tokens (NOT_FOUND, the proto's recovery).
    The replicas keep serving the same weights: a new adapter goes through the canary
    (`fedge.edge.fleet.rollout.run_rollout`; `fedge verifier restart --adapter` does that), so
    one application never mixes adapters. Returns the replica ids before and after.
    Refused while a canary rollout runs.
    """
    from ray import serve

    current = ingress.describe.remote().result()
    if current["canary"] is not None:
        raise RuntimeError(
            f"canary {current['canary']} is being rolled out; restart after its decision"
        )
    stable = current["stable"]
    config = stored_config(ingress, key)
    before = set(replica_actors(stable))
    started = time.monotonic()
    fresh = f"{config.replica_spec().code_version()}-restart-{uuid.uuid4().hex[:8]}"
    serve.run(replica_application(config, code_version=fresh), name=stable, route_prefix=None)
    ingress.promote.remote(stable, config.seal(key)).result()
    while before & set(replica_actors(stable)):  # serve.run returns before the last old one exits
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"old replicas of {stable} still alive after {timeout_s:.0f} s")
        time.sleep(0.2)
    after = set(replica_actors(stable))
    LOG.info("restarted %s in %.1f s: %s -> %s", stable, time.monotonic() - started, before, after)
    return {
        "app": stable,
        "before": sorted(before),
        "after": sorted(after),
        "seconds": time.monotonic() - started,
    }


def ingress_application(spec: IngressSpec, replicas: int = 1) -> Any:
    """The gRPC ingress deployment (`replicas` on one port, no CPU reserved), ready for `serve.run`."""
    from ray import serve

    if replicas > 1 and spec.redis_url is None:
        raise ValueError(f"{replicas} ingress replicas need a redis_url to share their state")
    return serve.deployment(
        name="ingress", num_replicas=replicas, ray_actor_options={"num_cpus": 0}
    )(FleetIngress).bind(spec)


def start_fleet(config: FleetConfig) -> Fleet:
    """Deploy version 1 (N replicas) and the ingress; returns once the ingress listens."""
    from ray import serve

    if config.fleet_key_file is None:  # a fresh key in a private directory, for this fleet
        home = Path(tempfile.mkdtemp(prefix="fedge-fleet-"))
        config = replace(config, fleet_key_file=write_key(home / KEY_FILE))
    config.key()  # refuse a missing, short or world-readable key before starting anything
    assert config.fleet_key_file is not None
    owns_ray = ensure_serve(config.fleet_key_file.parent if config.ray_auth else None)
    stable = version_app(1)
    serve.run(replica_application(config), name=stable, route_prefix=None)
    shared_port = config.port or (free_port(config.host) if config.ingress_replicas > 1 else 0)
    ingress = serve.run(
        ingress_application(config.ingress_spec(stable, shared_port), config.ingress_replicas),
        name=INGRESS_APP,
        route_prefix=None,
    )
    port = int(ingress.port.remote().result())
    LOG.info(
        "fleet of %d replicas (%s) behind %d ingress(es) on %s:%d",
        config.replicas,
        config.policy,
        config.ingress_replicas,
        config.host,
        port,
    )
    return Fleet(config, port, ingress, owns_ray)


@contextmanager
def running_fleet(config: FleetConfig) -> Iterator[Fleet]:
    """`start_fleet` ... `stop` as a context manager."""
    fleet = start_fleet(config)
    try:
        yield fleet
    finally:
        fleet.stop()
