"""The ingress's routing decisions over the fleet's shared state: where a call goes, what it leaves.

Plain Python over a `FleetState` (`fedge.edge.fleet.state`), no Serve and no gRPC, so every
ingress replica (and an ingress rebuilt after a crash) decides alike from the same
state, and the decisions are testable against a real Redis without a Ray cluster.
`fedge.edge.fleet.ingress.FleetIngress` wraps it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from google.protobuf.message import Message

from fedge.edge.fleet.state import FleetState, Routing
from fedge.edge.fleet.stats import CallOutcome
from fedge.edge.fleet.wire import CallResult
from fedge.edge.verifier.rate_config import RateLimitConfig

FLEET_KIND = "fedge.fleet-config"  # = fedge.edge.fleet.app.FLEET_KIND (no torch import here)

# Relay outcomes after which a session's home replica cannot serve it again: gone there (a dead
# or stopping replica is reported as NOT_FOUND by the relay) or its version retired. A transient
# failure (UNAVAILABLE), a full queue (RESOURCE_EXHAUSTED) or a bad request keeps the session
# where it is, so a retry returns to its replica instead of re-prefilling elsewhere.
HOME_LOST = frozenset({"NOT_FOUND", "FAILED_PRECONDITION"})


def owner_in_canary(owner: str, routing: Routing) -> bool:
    """Whether `owner`'s new sessions go to the canary: a hash of the owner and the canary,
    below the canary's share. Fixed for the canary's life, whatever the device sends (its
    `VerifyRequest.version` or reopens cannot move it to the other arm), and the same on
    every ingress."""
    digest = hashlib.sha256(f"{routing.canary}\0{owner}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < routing.fraction


class IngressState:
    """One ingress's view of the shared routing: reads it per call, writes what calls change.

    `declared` is the routing the ingress was deployed with and `epoch` names that
    deployment: the first ingress of an epoch writes it, any later one (a restart, a
    second replica) adopts what the state holds, promotions and canaries included.
    `on_limits` hears every change of the fleet's rate limits, whichever ingress made it.
    """

    def __init__(
        self,
        store: FleetState,
        declared: Routing,
        fleet: bytes,
        epoch: str,
        on_limits: Callable[[RateLimitConfig], None] | None = None,
        key: bytes | None = None,
    ) -> None:
        self.store = store
        self.routing = declared
        self._declared, self._fleet, self._epoch = declared, fleet, epoch
        self.on_limits = on_limits
        self._key = key  # the fleet key: a config not sealed with it is refused (None: opaque)

    def _check_sealed(self, fleet: bytes) -> bytes:
        """`fleet` when it is a FleetConfig sealed with the fleet key (any bytes without a key)."""
        if self._key is not None:
            from fedge.edge.fleet.sealed import unseal

            unseal(FLEET_KIND, fleet, self._key)  # SealError: tampered, or another fleet's
        return fleet

    async def start(self) -> Routing:
        """Write the declared routing unless this epoch's state exists; adopt what is in force."""
        self.routing = await self.store.start(self._epoch, self._declared, self._fleet)
        return self.routing

    def _adopt(self, routing: Routing) -> None:
        """Take the routing just read; tell `on_limits` when the limits changed."""
        if routing.limits != self.routing.limits and self.on_limits is not None:
            self.on_limits(routing.limits)
        self.routing = routing

    async def refresh(self) -> Routing:
        """Read the routing in force now."""
        routing, _ = await self.store.route("", "")
        self._adopt(routing)
        return routing

    # ------------------------------------------------------------------ per call
    async def target(self, session_id: str, owner: str = "", version: str = "") -> tuple[str, str]:
        """Application and home replica of a call: its session's, or a new session's pick.

        A session the fleet has not seen opens wherever the call lands (the edge opens
        sessions with their first Verify), so a new session takes part in the canary
        split: an identified owner's new sessions all go to the arm the ingress assigned it
        (`owner_in_canary`), an anonymous caller's (an open ingress) are split at random. A
        reopen naming its version returns to the application serving that version while
        one is live (else the stable one refuses it: version gone), but naming the canary's
        version does not put an owner the ingress left on the stable arm into the canary. A session whose application is
        no longer live goes to the stable one.
        """
        routing, home = await self.store.route(owner, session_id)
        self._adopt(routing)
        if home is not None:
            return home if routing.live(home[0]) else (routing.stable, "")
        assigned = bool(owner and routing.canary)  # the ingress assigns the arm, not the device
        in_canary = assigned and owner_in_canary(owner, routing)
        if version:
            app = await self.store.version_app(version)
            if app is None or not routing.live(app):
                return routing.stable, ""
            if assigned and app == routing.canary and not in_canary:
                return routing.stable, ""  # naming the canary's version does not join it
            return app, ""
        if assigned:
            return (routing.canary if in_canary else routing.stable), ""  # type: ignore[return-value]
        if routing.canary and random.random() < routing.fraction:
            return routing.canary, ""
        return routing.stable, ""

    async def remember(
        self,
        method: str,
        session_id: str,
        app: str,
        result: CallResult,
        owner: str = "",
        home: str = "",
    ) -> None:
        """Keep (or drop) `owner`'s session -> replica map after a relayed unary call (`home`: the
        replica `target` named, so a session that stayed put costs no write)."""
        if not session_id:
            return
        if method == "CloseSession" or result.code in HOME_LOST:
            await self.store.forget(owner, session_id)  # closed, or its home cannot serve it
        elif result.code == "OK" and not (home and result.replica == home):
            await self.store.remember(owner, session_id, app, result.replica)

    async def learn_version(self, reply: Message, app: str) -> None:
        """Note which application serves the version an open's reply reports."""
        fields = reply.DESCRIPTOR.fields_by_name
        if "opened" in fields:  # a Verify: set when it opened its session
            if not reply.HasField("opened"):
                return
            info: Any = reply.opened  # type: ignore[attr-defined]
        elif "model_id" in fields:  # an OpenSession
            info = reply
        else:
            return
        if info.model_id:
            await self.store.learn_version(f"{info.model_id}/{info.adapter_id}", app)

    async def observe(self, app: str, call: CallOutcome) -> None:
        """Feed the canary figures of `app` while a canary runs (every ingress into one count)."""
        if self.routing.canary is not None and self.routing.live(app):
            await self.store.record_arm(app, call)

    # ------------------------------------------------------------------ admin
    async def describe(self) -> dict[str, Any]:
        """Current applications and traffic split."""
        routing = await self.refresh()
        return {"stable": routing.stable, "canary": routing.canary, "fraction": routing.fraction}

    async def set_canary(self, app: str | None, fraction: float = 0.0) -> None:
        """Send `fraction` of new sessions to application `app` (None: no canary)."""
        if app is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"canary fraction must lie in (0, 1], got {fraction}")
        routing = await self.refresh()
        if app is not None:
            await self.store.reset_arms((routing.stable, app))
        await self.store.set_routing(
            replace(routing, canary=app, fraction=fraction if app else 0.0),
            fields=("canary", "fraction"),
        )
        await self.refresh()

    async def promote(self, app: str, fleet: bytes) -> None:
        """Make `app` (serving the sealed FleetConfig `fleet`) the stable application, in one
        step for every ingress; a config not sealed with the fleet key is refused."""
        self._check_sealed(fleet)
        routing = await self.refresh()
        promoted = replace(routing, stable=app, canary=None, fraction=0.0)
        await self.store.set_routing(promoted, fleet, fields=("stable", "canary", "fraction"))
        await self.refresh()

    async def set_rate_limits(self, config: RateLimitConfig) -> None:
        """Replace the fleet's per-device limits (every ingress adopts them on its next call)."""
        routing = await self.refresh()
        await self.store.set_routing(replace(routing, limits=config), fields=("limits",))
        await self.refresh()

    async def fleet_config(self) -> bytes:
        """The sealed FleetConfig of the stable version (the promoted adapter's), refused when
        what the store holds was not sealed with the fleet key (written by another hand)."""
        return self._check_sealed(await self.store.fleet())

    async def arm_stats(self) -> dict[str, dict[str, float]]:
        """Figures per application of the canary under way (stable and canary; none without)."""
        routing = await self.refresh()
        if routing.canary is None:
            return {}
        arms = await self.store.arm_stats((routing.stable, routing.canary))
        return {app: stats.summary() for app, stats in arms.items()}

    async def reset_arm_stats(self) -> None:
        """Forget both arms' figures of the canary under way: they start from zero together."""
        routing = await self.refresh()
        if routing.canary is not None:
            await self.store.reset_arms((routing.stable, routing.canary))

    async def rollout(self) -> dict[str, Any] | None:
        """The progress of the rollout under way (None: none)."""
        return await self.store.rollout()

    async def set_rollout(self, progress: dict[str, Any] | None) -> None:
        """Record a rollout's progress, so a controller or ingress that dies leaves it resumable."""
        await self.store.set_rollout(progress)
