"""Load-balancing policies of the verifier fleet, as Ray Serve request routers.

Each policy is a `ray.serve.request_router.RequestRouter` subclass (alpha API)
and runs inside the ingress's deployment handle. The ingress passes what a
policy needs as keyword arguments of the replica call (`ROUTE_TOKENS`: the
tokens the call will put through the target; `ROUTE_REPLICA`: the replica that
holds the call's session, when there is one). Routers return ranks of replicas;
Ray Serve then sends to the replica with the shortest reported queue within the
first rank that has room, and backs off when none has.

Session affinity (`affinity=True` in `request_router_kwargs`) wraps any policy:
a call whose session lives on a running replica goes there, since its KV cache
is there; a new session, or one whose replica is gone, follows the policy (and
the replica that gets it answers NOT_FOUND, so the edge reopens the session).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import defaultdict
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

ROUTE_TOKENS = "route_tokens"  # kwarg: tokens the call puts through the target
ROUTE_REPLICA = "route_replica"
SPEED_EWMA = 0.2  # weight of the newest completed call in a replica's seconds-per-token estimate  # kwarg: unique id of the replica holding the call's session


def _kwarg(request: PendingRequest | None, key: str, default: Any) -> Any:
    """A routing hint the ingress attached to the call, or `default`."""
    if request is None:
        return default
    return request.kwargs.get(key, default)


class FleetRouter(RequestRouter):
    """Shared state of the fleet policies: session affinity and this handle's outstanding work.

    Outstanding requests and tokens are counted per replica from the moment a call is
    routed until Ray Serve reports it completed (success, error or cancellation), so
    a slow replica accumulates work and the load-aware policies steer away from it.
    """

    affinity = False

    def initialize_state(self, affinity: bool = False, **kwargs: Any) -> None:
        """Read `request_router_kwargs`: `affinity` turns session affinity on."""
        self.affinity = bool(affinity)
        self.outstanding: dict[ReplicaID, int] = defaultdict(int)
        self.outstanding_tokens: dict[ReplicaID, int] = defaultdict(int)
        self._in_flight: dict[str, tuple[ReplicaID, int, float]] = {}
        self.seconds_per_token: dict[ReplicaID, float] = {}  # EWMA of completed calls

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        """Count the call against its replica until it completes."""
        tokens = int(_kwarg(pending_request, ROUTE_TOKENS, 1))
        self._in_flight[pending_request.metadata.internal_request_id] = (
            replica_id,
            tokens,
            time.monotonic(),
        )
        self.outstanding[replica_id] += 1
        self.outstanding_tokens[replica_id] += tokens

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Release the call's count."""
        routed = self._in_flight.pop(internal_request_id, None)
        if routed is None:
            return
        replica, tokens, started = routed
        self.outstanding[replica] -= 1
        self.outstanding_tokens[replica] -= tokens
        rate = (time.monotonic() - started) / tokens
        previous = self.seconds_per_token.get(replica, rate)
        self.seconds_per_token[replica] = previous + SPEED_EWMA * (rate - previous)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's counts as well as the replica."""
        super().on_replica_actor_died(replica_id)
        self.outstanding.pop(replica_id, None)
        self.outstanding_tokens.pop(replica_id, None)

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        """Give `replica` to the oldest waiting call it may serve (FIFO, within session affinity).

        Ray Serve's FIFOMixin hands the replica to the oldest call whatever it was
        chosen for, which would send a session's verify to another session's home;
        Serve's exact matching strands a call whose routing task exits early. Routing
        always ranks for the oldest call (`choose_replicas`), so both agree.
        """
        chosen = next(
            (
                pr
                for pr in self._pending_requests_to_fulfill
                if not pr.future.done() and self._suits(pr, replica)
            ),
            None,
        )
        if chosen is not None:
            self._record_queue_wait_time(chosen)
            chosen.future.set_result(replica)
            self._remove_pending_request_from_indices(chosen)

    def _suits(self, request: PendingRequest, replica: RunningReplica) -> bool:
        """Whether `replica` may serve `request`: any may, unless its session lives elsewhere."""
        home = _kwarg(request, ROUTE_REPLICA, "")
        if not self.affinity or not home or home == replica.replica_id.unique_id:
            return True
        return all(r.unique_id != home for r in self.curr_replicas)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks for the oldest waiting call: its session's replica, else the policy's ranking.

        Ranking for the oldest call (not the routing task's own) keeps it in step with
        `_fulfill_next_pending_request`. It yields to the event loop once: a rank
        answered from Serve's queue-length cache never awaits, and a routing task
        spinning on it would starve the loop the router shares with the caller.
        """
        await asyncio.sleep(0)
        pending_request = next(
            (pr for pr in self._pending_requests_to_fulfill if not pr.future.done()),
            pending_request,
        )
        if self.affinity:
            home = _kwarg(pending_request, ROUTE_REPLICA, "")
            for replica in candidate_replicas:
                if home and replica.replica_id.unique_id == home:
                    return [[replica]]
        return self.rank(candidate_replicas, pending_request)

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """The policy: ranks of replicas, most preferred first."""
        raise NotImplementedError

    def _by_load(
        self, candidates: list[RunningReplica], load: dict[ReplicaID, int]
    ) -> list[list[RunningReplica]]:
        """One replica per rank, least loaded first (ties broken at random)."""
        shuffled = random.sample(candidates, len(candidates))
        return [[r] for r in sorted(shuffled, key=lambda r: load.get(r.replica_id, 0))]


class RoundRobinRouter(FleetRouter):
    """Each call to the next replica in turn, whatever their load (the baseline)."""

    def initialize_state(self, affinity: bool = False, **kwargs: Any) -> None:
        """Start the turn counter."""
        super().initialize_state(affinity, **kwargs)
        self._turn = itertools.count()

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """The next replica in id order first, the rest after it in turn."""
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[r] for r in ordered[start:] + ordered[:start]]


class LeastOutstandingRouter(FleetRouter):
    """The replica with the fewest calls this ingress has in flight on it."""

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Fewest outstanding calls first."""
        return self._by_load(candidates, self.outstanding)


class PowerOfTwoRouter(FleetRouter):
    """Two replicas at random; Ray Serve sends to the one reporting the shorter queue."""

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """A random pair in one rank (Serve compares their probed queue lengths)."""
        return [random.sample(candidates, min(2, len(candidates)))]


class TokenAwareRouter(FleetRouter):
    """The replica expected to clear its pending target tokens soonest.

    A call's cost is the tokens it puts through the target (`ROUTE_TOKENS`): a long
    prompt's prefill or a long Generate weighs more than a one-token verify, so
    counting calls alone (least outstanding) misjudges a replica busy with prefills.
    Pending tokens are weighed by each replica's measured seconds per token (an
    EWMA over its completed calls), so a slower replica (older hardware, a noisy
    neighbour) gets proportionally less; a replica not yet measured counts as the
    fastest known.
    """

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Least expected time to clear pending tokens (plus this call's) first."""
        known = [
            self.seconds_per_token[r.replica_id]
            for r in candidates
            if r.replica_id in self.seconds_per_token
        ]
        fastest = min(known, default=1.0)
        tokens = int(_kwarg(request, ROUTE_TOKENS, 1))
        wait = {
            r.replica_id: (self.outstanding_tokens.get(r.replica_id, 0) + tokens)
            * self.seconds_per_token.get(r.replica_id, fastest)
            for r in candidates
        }
        shuffled = random.sample(candidates, len(candidates))
        return [[r] for r in sorted(shuffled, key=lambda r: wait[r.replica_id])]


POLICIES: dict[str, type[FleetRouter]] = {
    "round-robin": RoundRobinRouter,
    "least-outstanding": LeastOutstandingRouter,
    "power-of-two": PowerOfTwoRouter,
    "token-aware": TokenAwareRouter,
}


def policy_class(name: str) -> type[FleetRouter]:
    """The router class of a policy name; the error lists the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown load-balancing policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None


def policy_path(name: str) -> str:
    """Dotted import path of a policy's router class, as Ray Serve's RequestRouterConfig takes it."""
    cls = policy_class(name)
    return f"{cls.__module__}.{cls.__qualname__}"
