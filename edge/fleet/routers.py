"""Load-balancing policies of the verifier fleet, as Ray Serve request routers.

Each policy is a `ray.serve.request_router.RequestRouter` subclass (alpha API)
and runs inside the ingress's deployment handle. The ingress passes what a
policy needs as keyword arguments of the replica call (`ROUTE_TOKENS`: the
tokens the call will put through the target; `ROUTE_REPLICA`: the replica that
holds the call's session, when there is one; `ROUTE_SESSION`: an opaque key of the
session, never its id, to count the sessions active on each replica). Routers
return ranks of replicas; Ray Serve then sends to the replica with the shortest
reported queue within the first rank that has room, and backs off when none has.
Replicas report through Serve's routing stats whether they serve (`SERVING`) and how
fast they are per kind of call (`SPEEDS`), which only a replica can measure across
every ingress that sends it calls.

Placement sees placements made in the same instant: a call counts on its replica from the
moment a routing task ranks it (its first choice, tentatively) or gives it a replica, not only
once Serve hears it routed (after the replica accepted it, a round trip later), and each of
Serve's concurrent routing tasks ranks a call of its own (`FleetRouter._ranked_request`), so a
burst of new sessions spreads over equal replicas instead of all taking one's first choice.

A call pinned to a replica (`ROUTE_PIN`: an admin call such as a drain, or the
ingress closing a session that moved) goes to that replica whatever its state,
or, when it is gone, to any replica, which refuses it (NOT_FOUND).

Session affinity (`affinity=True` in `request_router_kwargs`) wraps any policy:
a call whose session lives on a running replica goes there, since its KV cache
is there; a new session, or one whose replica is gone, follows the policy (and
the replica that gets it answers NOT_FOUND, so the edge reopens the session).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from fedge.edge.fleet.speed import SpeedMeter, call_kind, work_tokens
from fedge.edge.fleet.wire import ROUTE_PIN, ROUTE_TOKENS, SERVING, SPEEDS

ROUTE_REPLICA = "route_replica"  # kwarg: unique id of the replica holding the call's session
ROUTE_MOVE_TOKENS = "route_move_tokens"  # kwarg: tokens a reopen elsewhere would prefill
ROUTE_SESSION = "route_session"  # kwarg: an opaque key of the call's session ("" for none)
K = TypeVar("K", bound=Hashable)  # a replica's key (ReplicaID in Serve, anything in tests)
EARLY_COMPLETIONS_KEPT = 256  # calls heard complete before routed; their routing follows at once
SPILL_FACTOR = 3.0  # leave the home replica when its expected time is this many times another's
STREAM_METHOD = "Generate"  # a cloud-only stream: one call for its whole life, no session
CLOSE_METHOD = "CloseSession"  # the session leaves its replica
# A session is active on a replica while its last call there began or ended within this many
# seconds. Between a decoding session's calls lie the device's drafting and a network round
# trip (tens to a few hundred ms; a full queue's retry-after is 0.1 s), so a decoding session
# never drops out; a session that ended without a close, went quiet or moved stops counting
# within a few seconds, before several such sessions could weigh on the next placements.
SESSION_ACTIVE_S = 3.0
# A call counts on the replica it is being placed on from the moment it is ranked (tentatively,
# on its first choice) or given a replica, until Serve reports it routed there (the replica
# accepted it: a round trip later) or it completes; a placement never heard of again (its
# caller gave up) stops counting after this many seconds.
PLACING_MAX_S = 10.0


def relative_slowness(
    speed: Mapping[tuple[K, str], float], replicas: Sequence[K]
) -> dict[K, float]:
    """Each replica's seconds per token over the fastest's, on kinds of call two or more served.

    The median ratio over shared kinds; 1.0 for a replica with no shared kind yet
    (an unmeasured replica counts as the fastest, so it gets measured).
    """
    by_kind: dict[str, dict[K, float]] = defaultdict(dict)
    for (replica, kind), seconds in speed.items():
        if replica in replicas and seconds > 0:
            by_kind[kind][replica] = seconds
    ratios: dict[K, list[float]] = defaultdict(list)
    for measured in by_kind.values():
        if len(measured) >= 2:
            fastest = min(measured.values())
            for replica, seconds in measured.items():
                ratios[replica].append(seconds / fastest)
    return {r: float(statistics.median(ratios[r])) if ratios[r] else 1.0 for r in replicas}


def expected_time(slowness: float, pending_tokens: float, tokens: float) -> float:
    """A call's expected time on a replica, in fastest-replica token times: the work it waits
    through (`work_tokens`) at the replica's relative slowness."""
    return slowness * work_tokens(pending_tokens, tokens)


def should_spill(
    home: float, best_other: float, move_tokens: int, home_slowness: float, other_slowness: float
) -> bool:
    """Move a session only off a replica measured `SPILL_FACTOR` x slower than another, and only
    when its expected time there exceeds `SPILL_FACTOR` x the other's plus the reopen (prefilling
    the committed tokens).

    Pending tokens alone never move a session: concurrent verifies share a batched pass, so
    a busy home costs less than its pending tokens suggest, and a move costs a round trip.
    """
    if home_slowness < SPILL_FACTOR * other_slowness:
        return False
    return home > SPILL_FACTOR * (best_other + other_slowness * move_tokens)


def serving(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """The replicas whose verifier last reported SERVING (all of them when none did).

    A replica reports it through Serve's routing stats (`VerifierReplica.record_routing_stats`);
    one that has not reported yet counts as serving.
    """
    live = [r for r in replicas if r.routing_stats.get(SERVING, True)]
    return live or replicas


def _kwarg(request: PendingRequest | None, key: str, default: Any) -> Any:
    """A routing hint the ingress attached to the call, or `default`."""
    if request is None:
        return default
    return request.kwargs.get(key, default)


def _request_id(request: PendingRequest | None) -> str:
    """The call's internal request id ("" when unknown)."""
    metadata = getattr(request, "metadata", None)
    return str(getattr(metadata, "internal_request_id", "") or "")


def _method(request: PendingRequest | None) -> str:
    """The relayed method's name (the replica call's first argument), or "" when unknown."""
    args = getattr(request, "args", None) or ()
    return str(args[0]) if args else ""


class FleetRouter(RequestRouter):
    """Shared state of the fleet policies: session affinity, this handle's outstanding work, speeds,
    the sessions active on each replica.

    Outstanding requests and tokens are counted per replica from the moment a call is
    routed until Ray Serve reports it completed (success, error or cancellation), so
    a slow replica accumulates work and the load-aware policies steer away from it.
    Each completed call also updates its replica's seconds per token for its kind of
    call (`call_kind`, `fedge.edge.fleet.speed.SpeedMeter`); `relative_slowness` compares
    replicas on these. A call's tokens are the work it waited through (`work_tokens`: the
    replica's pending tokens when it was routed, and its own), so a speed is the replica's,
    not its queue's: per token of the call alone, a fast replica given most of the load
    looked nearly as slow as a lightly loaded slowed one (in the bench, verify p50 70-107 ms
    against 103-149 ms: 1.4-1.6x apart where 4x was set), and token-aware sent a fifth to a
    third of the calls to the slowed replica. Each ingress's router sees only its own calls,
    so only part of a replica's queue: replicas measure themselves behind all of it and
    report it (`SPEEDS`), and the routers compare replicas on those reports once every
    replica has one (`current_speed`); their own measurements serve until then.
    A session counts as active on a replica while it calls there (`SESSION_ACTIVE_S`), by the
    opaque key the ingress sends (`ROUTE_SESSION`). A device's calls keep to one connection,
    so to one ingress: each ingress counts its devices' sessions, and balancing its own
    balances the fleet.
    """

    affinity = False

    def initialize_state(self, affinity: bool = False, **kwargs: Any) -> None:
        """Read `request_router_kwargs`: `affinity` turns session affinity on."""
        self.affinity = bool(affinity)
        self.outstanding: dict[ReplicaID, int] = defaultdict(int)
        self.outstanding_tokens: dict[ReplicaID, int] = defaultdict(int)
        self._in_flight: dict[str, tuple[ReplicaID, int, int, str, float, str]] = {}
        self._meter: SpeedMeter[tuple[ReplicaID, str]] = SpeedMeter()
        self.speed = self._meter.speed  # median s/work token per (replica, kind), as measured here
        self._completed_early: OrderedDict[str, None] = OrderedDict()
        self.session_calls = 0  # calls of sessions this handle routed (not streams, not pinned)
        self.session_tokens = 0  # the tokens of those calls
        self.sessions_placed = 0  # of them, those placed without a home: a session's first
        self._active: dict[ReplicaID, OrderedDict[str, float]] = defaultdict(OrderedDict)
        # request id -> (replica, tokens, session key, since): calls ranked or given a replica
        # and not yet heard routed (`PLACING_MAX_S`), so calls placed in one instant see each other
        self._placing: dict[str, tuple[ReplicaID, int, str, float]] = {}
        self._claims: dict[str, asyncio.Task[Any]] = {}  # request id -> the task ranking for it
        # routing task -> the waiting call it ranked replicas for last: the call
        # `_fulfill_next_pending_request` gives the replica it picked (no module-level context
        # variable: Serve pickles the router's module by value into the ingress's handle)
        self._ranked_by: weakref.WeakKeyDictionary[asyncio.Task[Any], PendingRequest] = (
            weakref.WeakKeyDictionary()
        )

    def _ranked_for(self) -> PendingRequest | None:
        """The waiting call the current routing task ranked replicas for last (None: none)."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return None
        return None if task is None else self._ranked_by.get(task)

    def _rank_for(self, request: PendingRequest) -> None:
        """Note that the current routing task ranks replicas for `request`."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        if task is not None:
            self._ranked_by[task] = request

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        """Count the call against its replica until it completes, noting the work ahead of it
        (nothing, when it has completed already: `on_request_completed`), and its session as
        active there (gone, after its close).

        A pinned call (an admin call, the close of a moved session) is no session's call.
        """
        request_id, method = pending_request.metadata.internal_request_id, _method(pending_request)
        self._placing.pop(request_id, None)
        self._claims.pop(request_id, None)
        tokens = int(_kwarg(pending_request, ROUTE_TOKENS, 1))
        session = str(_kwarg(pending_request, ROUTE_SESSION, ""))
        if method == CLOSE_METHOD:
            self._leave(replica_id, session)
            session = ""  # its completion must not mark it active again
        self._seen(replica_id, session)
        if method != STREAM_METHOD and not _kwarg(pending_request, ROUTE_PIN, ""):
            self.session_calls += 1
            self.session_tokens += tokens
            self.sessions_placed += not _kwarg(pending_request, ROUTE_REPLICA, "")
        if request_id in self._completed_early:
            del self._completed_early[request_id]
            return
        self._in_flight[request_id] = (
            replica_id,
            tokens,
            self.outstanding_tokens[replica_id],
            call_kind(method, tokens),
            time.monotonic(),
            session,
        )
        self.outstanding[replica_id] += 1
        self.outstanding_tokens[replica_id] += tokens

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Release the call's count; update its replica's speed on this kind of call.

        Serve registers this callback before it reports the call routed (once the replica
        has accepted it), and both run on the router's event loop, so a call that finishes
        before the loop gets to its routing completes first: it is remembered (the last
        `EARLY_COMPLETIONS_KEPT`) and its routing then counts nothing. Counted, it stayed
        outstanding for good on its replica, which then looked ever busier.
        """
        self._placing.pop(internal_request_id, None)
        routed = self._in_flight.pop(internal_request_id, None)
        if routed is None:
            self._completed_early[internal_request_id] = None
            if len(self._completed_early) > EARLY_COMPLETIONS_KEPT:
                self._completed_early.popitem(last=False)
            return
        replica, tokens, ahead, kind, started, session = routed
        self._seen(replica, session)
        self.outstanding[replica] -= 1
        self.outstanding_tokens[replica] -= tokens
        seconds = time.monotonic() - started
        self._meter.record((replica, kind), seconds, work_tokens(ahead, tokens))

    def calls_per_session(self) -> float:
        """Calls a session has made on average, as this handle saw them (1.0 before any)."""
        return self.session_calls / self.sessions_placed if self.sessions_placed else 1.0

    def tokens_per_call(self) -> float:
        """Target tokens of a session's call on average, as this handle saw them (0 before any)."""
        return self.session_tokens / self.session_calls if self.session_calls else 0.0

    def _seen(self, replica_id: ReplicaID, session: str) -> None:
        """Note that `session` (a `ROUTE_SESSION` key; "" for none) called `replica_id` now.

        Noted when a call is routed and again when it completes: a call longer than
        `SESSION_ACTIVE_S` (a long prefill on a slow replica) leaves its session active.
        """
        if session:
            sessions = self._active[replica_id]
            sessions[session] = time.monotonic()
            sessions.move_to_end(session)

    def _leave(self, replica_id: ReplicaID, session: str) -> None:
        """Forget `session` on `replica_id` at once: it closed there."""
        if replica_id in self._active:
            self._active[replica_id].pop(session, None)

    def active_sessions(self, replica_id: ReplicaID, request: PendingRequest | None = None) -> int:
        """Sessions that called `replica_id` within `SESSION_ACTIVE_S` (older ones are dropped,
        oldest first: the map is kept in order of last call), and those being placed there
        (`placing`) other than `request`'s own."""
        sessions = self._active.get(replica_id)
        if sessions:
            horizon = time.monotonic() - SESSION_ACTIVE_S
            while sessions and next(iter(sessions.values())) < horizon:
                sessions.popitem(last=False)
        known: Mapping[str, float] = sessions or {}
        placing = {
            session
            for replica, _, session in self.placing(request)
            if replica == replica_id and session and session not in known
        }
        return len(known) + len(placing)

    def placing(self, request: PendingRequest | None = None) -> list[tuple[ReplicaID, int, str]]:
        """(replica, tokens, session key) of each call being placed now, other than `request`:
        ranked or given a replica and not yet heard routed. Stale ones are dropped."""
        horizon = time.monotonic() - PLACING_MAX_S
        for rid in [rid for rid, entry in self._placing.items() if entry[3] < horizon]:
            del self._placing[rid]
        own = _request_id(request)
        return [entry[:3] for rid, entry in self._placing.items() if rid != own]

    def pending_tokens(self, replica_id: ReplicaID, request: PendingRequest | None = None) -> int:
        """Tokens outstanding on `replica_id` plus those of the calls being placed there."""
        placing = sum(t for replica, t, _ in self.placing(request) if replica == replica_id)
        return self.outstanding_tokens.get(replica_id, 0) + placing

    def pending_calls(self, replica_id: ReplicaID, request: PendingRequest | None = None) -> int:
        """Calls outstanding on `replica_id` plus the calls being placed there."""
        placing = sum(1 for replica, _, _ in self.placing(request) if replica == replica_id)
        return self.outstanding.get(replica_id, 0) + placing

    def _place(self, request: PendingRequest, replica_id: ReplicaID) -> None:
        """Count `request` on `replica_id` until it is heard routed or completed (`placing`)."""
        rid = _request_id(request)
        if rid:
            tokens = int(_kwarg(request, ROUTE_TOKENS, 1))
            session = str(_kwarg(request, ROUTE_SESSION, ""))
            self._placing[rid] = (replica_id, tokens, session, time.monotonic())

    def _ranked_request(self, given: PendingRequest | None) -> PendingRequest | None:
        """The waiting call this routing task ranks replicas for: the one it ranked last while
        still waiting, else the oldest that no other live routing task is ranking (several
        tasks ranking the oldest at once all ranked it alike and then gave its first choice to
        as many calls), else the oldest, else `given`."""
        waiting = [pr for pr in self._pending_requests_to_fulfill if not pr.future.done()]
        if not waiting:
            return given
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        live = {_request_id(pr) for pr in waiting}
        self._claims = {rid: t for rid, t in self._claims.items() if rid in live and not t.done()}
        mine = self._ranked_for()
        mine_waiting = mine is not None and not mine.future.done()
        if mine_waiting and task is not None and self._claims.get(_request_id(mine)) is task:
            return mine
        for pr in waiting:
            owner = self._claims.get(_request_id(pr))
            if owner is None or owner is task:
                if task is not None:
                    self._claims[_request_id(pr)] = task
                self._rank_for(pr)
                return pr
        self._rank_for(waiting[0])
        return waiting[0]

    def current_speed(
        self, candidates: Sequence[RunningReplica]
    ) -> dict[tuple[ReplicaID, str], float]:
        """The speeds to compare `candidates` on: the replicas' own reports (`SPEEDS`, in
        their routing stats: `fedge.edge.fleet.speed.ReplicaSpeed`) when every candidate has
        reported, else those this handle measured within `SPEED_MAX_AGE_S` (`SpeedMeter`).

        A replica's report counts every call in flight there, from every ingress; this
        handle counts its own calls only. The two are not mixed: a replica measured behind
        part of its queue looks slower than one measured behind all of it.
        """
        reports = [r.routing_stats.get(SPEEDS) for r in candidates]
        if candidates and all(report is not None for report in reports):
            return {
                (replica.replica_id, kind): seconds
                for replica, report in zip(candidates, reports, strict=True)
                for kind, seconds in report.items()  # type: ignore[union-attr]
            }
        return self._meter.current()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's counts and speeds as well as the replica."""
        super().on_replica_actor_died(replica_id)
        self.outstanding.pop(replica_id, None)
        self.outstanding_tokens.pop(replica_id, None)
        self._meter.keep(lambda key: key[0] != replica_id)
        self._active.pop(replica_id, None)
        self._placing = {k: v for k, v in self._placing.items() if v[0] != replica_id}

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        """Give `replica` to the oldest waiting call it may serve (FIFO, within session affinity).

        Ray Serve's FIFOMixin hands the replica to the oldest call whatever it was
        chosen for, which would send a session's verify to another session's home;
        Serve's exact matching strands a call whose routing task exits early. Routing
        always ranks for the oldest call (`choose_replicas`), so both agree.
        """
        ranked = self._ranked_for()
        if ranked is not None and not ranked.future.done() and self._suits(ranked, replica):
            chosen: PendingRequest | None = ranked
        else:
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
            self._place(chosen, replica.replica_id)
            self._claims.pop(_request_id(chosen), None)
            chosen.future.set_result(replica)
            self._remove_pending_request_from_indices(chosen)

    def _suits(self, request: PendingRequest, replica: RunningReplica) -> bool:
        """Whether `replica` may serve `request`: any may, unless it is pinned or its session
        stays elsewhere."""
        pin = _kwarg(request, ROUTE_PIN, "")
        if pin:
            ids = {r.replica_id.unique_id for r in self.curr_replicas.values()}
            return pin == replica.replica_id.unique_id or pin not in ids
        home = _kwarg(request, ROUTE_REPLICA, "")
        if not self.affinity or not home or home == replica.replica_id.unique_id:
            return True
        live = serving(list(self.curr_replicas.values()))
        homes = [r for r in live if r.replica_id.unique_id == home]
        return not homes or self.leave_home(homes[0], live, request)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks for the oldest waiting call: its pinned replica, its session's, else the policy's.

        Ranking for the oldest call (not the routing task's own) keeps it in step with
        `_fulfill_next_pending_request`. It yields to the event loop once: a rank
        answered from Serve's queue-length cache never awaits, and a routing task
        spinning on it would starve the loop the router shares with the caller.
        """
        await asyncio.sleep(0)
        pending_request = self._ranked_request(pending_request)
        ranks = self._ranks(candidate_replicas, pending_request)
        claimed = _request_id(pending_request) in self._claims
        if pending_request is not None and ranks and ranks[0] and claimed:
            self._place(pending_request, ranks[0][0].replica_id)  # tentatively, its first choice
        return ranks

    def _ranks(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """`choose_replicas` for one call: its pinned replica, its session's, else the policy's."""
        pin = _kwarg(pending_request, ROUTE_PIN, "")
        pinned = [r for r in candidate_replicas if pin and r.replica_id.unique_id == pin]
        if pinned:  # serving or not: a drained replica still takes its admin calls
            return [pinned]
        candidate_replicas = serving(candidate_replicas)
        if self.affinity:
            home = _kwarg(pending_request, ROUTE_REPLICA, "")
            for replica in candidate_replicas:
                if home and replica.replica_id.unique_id == home:
                    if not self.leave_home(replica, candidate_replicas, pending_request):
                        return [[replica]]
                    others = [r for r in candidate_replicas if r is not replica]
                    return self.rank(others, pending_request)
        return self.rank(candidate_replicas, pending_request)

    def leave_home(
        self,
        home: RunningReplica,
        candidates: list[RunningReplica],
        request: PendingRequest | None,
    ) -> bool:
        """Whether a session's call should leave its replica (the session then reopens elsewhere).

        Never, for policies that do not model expected time: affinity is absolute there.
        """
        return False

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """The policy: ranks of replicas, most preferred first."""
        raise NotImplementedError

    def _by_load(
        self, candidates: list[RunningReplica], load: Mapping[ReplicaID, float]
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
        """Fewest outstanding calls (those being placed included) first."""
        return self._by_load(
            candidates,
            {r.replica_id: self.pending_calls(r.replica_id, request) for r in candidates},
        )


class PowerOfTwoRouter(FleetRouter):
    """Two replicas at random; Ray Serve sends to the one reporting the shorter queue."""

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """A random pair in one rank (Serve compares their probed queue lengths)."""
        return [random.sample(candidates, min(2, len(candidates)))]


class TokenAwareRouter(FleetRouter):
    """The replica expected to serve the call soonest; sessions leave a replica far worse than another.

    A call's cost is the tokens it puts through the target (`ROUTE_TOKENS`): a long
    prompt's prefill or a long Generate weighs more than a one-token verify, so
    counting calls alone (least outstanding) misjudges a replica busy with prefills.
    Expected time = relative slowness x (pending tokens + the call's tokens), where
    slowness is measured per kind of call (`relative_slowness`, on the replicas' own
    reports: `FleetRouter.current_speed`), so a slower replica (older hardware, a noisy
    neighbour) gets proportionally less. A session's first call
    is placed for the session's life (`lifetime`). With affinity, a
    session's call stays home unless home is measured `SPILL_FACTOR` times slower and its
    expected time exceeds that factor times the best other's plus the reopen (`should_spill`): the call
    then lands elsewhere, which answers NOT_FOUND, and the edge reopens the session
    from its committed tokens on the faster replica.
    """

    def _slowness(self, candidates: list[RunningReplica]) -> dict[ReplicaID, float]:
        """Each candidate's relative slowness on the speeds heard of lately."""
        return relative_slowness(self.current_speed(candidates), [r.replica_id for r in candidates])

    def _expected(
        self,
        candidates: list[RunningReplica],
        tokens: int,
        slow: Mapping[ReplicaID, float],
        request: PendingRequest | None = None,
    ) -> dict[ReplicaID, float]:
        """Expected time of a `tokens` call on each candidate, at its slowness `slow`, behind
        its outstanding calls and those being placed there (`request`'s own aside)."""
        return {
            r.replica_id: expected_time(
                slow[r.replica_id], self.pending_tokens(r.replica_id, request), tokens
            )
            for r in candidates
        }

    def rank(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Least expected time first; a session's call, for the session's life (`lifetime`)."""
        slow = self._slowness(candidates)
        expected = self._expected(candidates, int(_kwarg(request, ROUTE_TOKENS, 1)), slow, request)
        if _method(request) != STREAM_METHOD:
            expected = self.lifetime(candidates, expected, slow, request)
        return self._by_load(candidates, expected)

    def lifetime(
        self,
        candidates: list[RunningReplica],
        expected: Mapping[ReplicaID, float],
        slow: Mapping[ReplicaID, float],
        request: PendingRequest | None = None,
    ) -> dict[ReplicaID, float]:
        """Where a session is placed, its later calls follow (its KV cache is there): its
        cost is this call's expected time plus, for each further call a session makes on
        average, the expected time there of an average session call behind one such call
        of each session active there (`active_sessions`), whose calls it will queue behind
        or share a batched pass with.

        A queue drains; a slower replica and the sessions on it stay for the session's life.
        Each session placed makes its replica dearer for the next, so equal replicas take
        turns (fewest sessions, weighed by slowness), and a replica 4x slower gets a session
        only once the fast one's sessions cost more than the 4x. Placed by the one call
        alone, a session went to the 4x slower replica whenever the fast one held a few
        calls, and every later call of it paid the 4x; weighed over a session's life by
        slowness alone, a small measured gap between two equal replicas (load and noise)
        sent every session to one of them, which then measured slow, and its sessions
        spilled and reopened."""
        later_calls = max(0.0, self.calls_per_session() - 1)
        per_call = self.tokens_per_call()
        return {
            r.replica_id: expected[r.replica_id]
            + later_calls
            * expected_time(
                slow[r.replica_id], self.active_sessions(r.replica_id, request) * per_call, per_call
            )
            for r in candidates
        }

    def leave_home(
        self,
        home: RunningReplica,
        candidates: list[RunningReplica],
        request: PendingRequest | None,
    ) -> bool:
        """Spill when home's expected time is far worse than the best other's plus a reopen."""
        others = [r for r in candidates if r.replica_id != home.replica_id]
        if not others:
            return False
        tokens = int(_kwarg(request, ROUTE_TOKENS, 1))
        slow = self._slowness([home, *others])
        expected = self._expected([home, *others], tokens, slow, request)
        best = min(others, key=lambda r: expected[r.replica_id]).replica_id
        move = int(_kwarg(request, ROUTE_MOVE_TOKENS, 0))
        return should_spill(
            expected[home.replica_id], expected[best], move, slow[home.replica_id], slow[best]
        )


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
