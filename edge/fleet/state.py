"""The fleet's shared state: routing, rollout progress, sessions, versions, token buckets, canary figures.

Every ingress replica reads and writes this state instead of keeping it, so any
ingress can die and another (or its restart) carries on: the live and canary
applications and the split, the promoted fleet config (adapter), the live rate
limits, the progress of a rollout, each session's home (scoped by owner), which
application serves a model version, every device's token buckets and the canary's
per-application figures. `RedisState` (`fedge.edge.fleet.redis_state`) keeps it in a Redis server (the `redis`
client, asyncio); `MemoryState` keeps it in the process, for the single-ingress
default without a Redis (it dies with its ingress, as the state did before).

A state belongs to one fleet start (`epoch`): the first ingress of a new start
writes its declared routing; a restarted ingress of the same start finds the state
and adopts it (a promotion, a canary, new limits survive). Token buckets are
charged atomically in the server (a Lua script using the server's clock), so a
device alternating between ingresses spends one budget.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from fedge.edge.fleet.stats import ArmStats, CallOutcome
from fedge.edge.verifier.limits import DeviceBuckets
from fedge.edge.verifier.rate_config import RateLimitConfig

ROUTING = ("stable", "canary", "fraction", "limits")  # the fields of Routing


@dataclass(frozen=True)
class Routing:
    """Where new calls go: the stable application, an optional canary and its share; the limits."""

    stable: str
    canary: str | None = None
    fraction: float = 0.0
    limits: RateLimitConfig = field(default_factory=RateLimitConfig)

    def live(self, app: str) -> bool:
        """Whether `app` may receive calls."""
        return app in (self.stable, self.canary)


class SharedBuckets(Protocol):
    """One kind's token buckets (rate, burst) of every device, charged wherever the state lives."""

    rate: float
    burst: int

    def take(self, device: str, cost: int, debt: bool = False) -> Awaitable[float]: ...

    def refund(self, device: str, amount: int) -> Awaitable[None]: ...


class FleetState(Protocol):
    """What every ingress of one fleet shares (see the module docstring)."""

    async def start(self, epoch: str, routing: Routing, fleet: bytes) -> Routing:
        """Write `routing` and `fleet` unless this epoch's state exists; the routing in force."""
        ...

    async def route(self, owner: str, session_id: str) -> tuple[Routing, tuple[str, str] | None]:
        """The routing and `owner`'s session home (application, replica), in one read."""
        ...

    async def set_routing(
        self, routing: Routing, fleet: bytes | None = None, fields: tuple[str, ...] = ROUTING
    ) -> None:
        """Write `fields` of `routing` (and the fleet config when given), in one step for every
        ingress; the other fields stay as stored (another ingress may have just changed them)."""
        ...

    async def fleet(self) -> bytes:
        """The sealed FleetConfig of the stable version."""
        ...

    async def remember(self, owner: str, session_id: str, app: str, replica: str) -> None:
        """Note where `owner`'s session lives."""
        ...

    async def forget(self, owner: str, session_id: str) -> None:
        """Drop `owner`'s session (closed, or its home can no longer serve it)."""
        ...

    async def sessions_per_replica(self) -> dict[str, int]:
        """Known sessions per replica id."""
        ...

    async def version_app(self, version: str) -> str | None:
        """The application serving model version `version` (model_id/adapter_id), if known."""
        ...

    async def learn_version(self, version: str, app: str) -> None:
        """Note that `app` serves `version`."""
        ...

    def buckets(self, kind: str, rate: float, burst: int) -> SharedBuckets:
        """The shared buckets of one kind of token."""
        ...

    async def record_arm(self, app: str, call: CallOutcome) -> None:
        """Count one finished call of canary arm `app`."""
        ...

    async def arm_stats(self, apps: tuple[str, ...]) -> dict[str, ArmStats]:
        """The figures of each arm in `apps` (empty ones for an arm with no calls yet)."""
        ...

    async def reset_arms(self, apps: tuple[str, ...]) -> None:
        """Forget the figures of `apps` (a new canary starts from zero)."""
        ...

    async def rollout(self) -> dict[str, Any] | None:
        """The progress of the rollout under way, or None."""
        ...

    async def set_rollout(self, progress: dict[str, Any] | None) -> None:
        """Record a rollout's progress (None: no rollout under way)."""
        ...

    async def close(self) -> None:
        """Release the connection."""
        ...


# --------------------------------------------------------------------------- in memory
class MemoryBuckets:
    """Per-process buckets behind the shared-buckets interface (one ingress only)."""

    def __init__(self, buckets: DeviceBuckets) -> None:
        self.rate, self.burst, self._buckets = buckets.rate, buckets.burst, buckets

    async def take(self, device: str, cost: int, debt: bool = False) -> float:
        return self._buckets.take(device, cost, debt)

    async def refund(self, device: str, amount: int) -> None:
        self._buckets.refund(device, amount)


class MemoryState:
    """The fleet's state in this process: the default of a fleet with one ingress and no Redis."""

    def __init__(self, max_devices: int = 100_000, max_sessions: int = 100_000) -> None:
        self._routing: Routing | None = None
        self._fleet = b""
        self._epoch = ""
        self._sessions: dict[tuple[str, str], tuple[str, str]] = {}
        self._max_sessions = max_sessions
        self._versions: dict[str, str] = {}
        self._buckets: dict[tuple[str, float, int], MemoryBuckets] = {}
        self._max_devices = max_devices
        self._arms: dict[str, ArmStats] = {}
        self._rollout: dict[str, Any] | None = None

    async def start(self, epoch: str, routing: Routing, fleet: bytes) -> Routing:
        if self._routing is None or self._epoch != epoch:
            self._epoch, self._routing, self._fleet = epoch, routing, fleet
            self._versions.clear()
            self._rollout = None
        return self._routing

    async def route(self, owner: str, session_id: str) -> tuple[Routing, tuple[str, str] | None]:
        assert self._routing is not None, "FleetState.start first"
        return self._routing, self._sessions.get((owner, session_id))

    async def set_routing(
        self, routing: Routing, fleet: bytes | None = None, fields: tuple[str, ...] = ()
    ) -> None:
        assert self._routing is not None, "FleetState.start first"
        self._routing = replace(
            self._routing, **{f: getattr(routing, f) for f in fields or ROUTING}
        )
        if fleet is not None:
            self._fleet = fleet

    async def fleet(self) -> bytes:
        return self._fleet

    async def remember(self, owner: str, session_id: str, app: str, replica: str) -> None:
        self._sessions.pop((owner, session_id), None)
        self._sessions[(owner, session_id)] = (app, replica)
        while len(self._sessions) > self._max_sessions:
            self._sessions.pop(next(iter(self._sessions)))

    async def forget(self, owner: str, session_id: str) -> None:
        self._sessions.pop((owner, session_id), None)

    async def sessions_per_replica(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, replica in self._sessions.values():
            counts[replica] = counts.get(replica, 0) + 1
        return counts

    async def version_app(self, version: str) -> str | None:
        return self._versions.get(version)

    async def learn_version(self, version: str, app: str) -> None:
        self._versions[version] = app

    def buckets(self, kind: str, rate: float, burst: int) -> MemoryBuckets:
        key = (kind, rate, burst)
        if key not in self._buckets:
            self._buckets[key] = MemoryBuckets(
                DeviceBuckets(rate, burst, self._max_devices, time.monotonic)
            )
        return self._buckets[key]

    async def record_arm(self, app: str, call: CallOutcome) -> None:
        self._arms.setdefault(app, ArmStats()).record(call)

    async def arm_stats(self, apps: tuple[str, ...]) -> dict[str, ArmStats]:
        return {app: self._arms.get(app, ArmStats()) for app in apps}

    async def reset_arms(self, apps: tuple[str, ...]) -> None:
        for app in apps:
            self._arms[app] = ArmStats()

    async def rollout(self) -> dict[str, Any] | None:
        return None if self._rollout is None else dict(self._rollout)

    async def set_rollout(self, progress: dict[str, Any] | None) -> None:
        self._rollout = None if progress is None else dict(progress)

    async def close(self) -> None:
        return None


def open_state(
    url: str | None,
    password_file: Path | None = None,
    max_devices: int = 100_000,
    session_ttl_s: float | None = None,
    max_sessions_per_owner: int | None = None,
) -> FleetState:
    """The fleet's state: in the Redis at `url`, else in this process (one ingress only).
    `session_ttl_s`: a session's home expires this long after its last call (Redis)."""
    if url is None:
        return MemoryState(max_devices)
    from fedge.edge.fleet.redis_state import MAX_SESSIONS_PER_OWNER, SESSION_TTL_S, RedisState

    return RedisState.connect(
        url,
        password_file,
        session_ttl_s=session_ttl_s or SESSION_TTL_S,
        max_sessions_per_owner=max_sessions_per_owner or MAX_SESSIONS_PER_OWNER,
    )
