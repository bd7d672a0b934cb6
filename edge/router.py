"""Offload router: per request, the cheapest route (edge-only, speculative, cloud-only) that meets
the request's service objective, unless another is clearly faster, learnt online from every
request's outcome.

Each request has an `Objective`: end-to-end tokens per second and time to first token (TTFT).
Each route has a cost per token, in units of one target pass in the cloud:

    cost = pass_cost * load * passes/token + byte_cost * bytes/token
           + joule_cost * battery_factor * thermal_factor * device joules/token

where `load` grows with the verifier's queue depth and after RESOURCE_EXHAUSTED, the battery
factor is 1/battery when not charging, and device joules are the draft steps and radio bytes
the route spends (`DeviceState` gives joules per draft token and per byte: inputs measured on
the device). Per route the router keeps running estimates of seconds per token, TTFT, passes,
bytes, draft steps and round trips per token, the share of time spent waiting on the cloud,
and the RTT they were measured at; a prediction moves them to the current RTT (each round trip
costs the RTT difference, removing no more than the time spent waiting) and load. Beside that
model, each route keeps its throughput as observed on the current network (`Throughput`:
decayed tokens over seconds of its requests, started afresh when the RTT moves): a route's
speed is that observation when there is one, else the model's prediction. Cost decides between
routes of about the same speed; speed decides when they differ clearly (`clearly_faster`).
Policies, tried in order (ordered dispatch, default last):

1. network down -> edge-only (the only way to answer; the report says so);
2. a feasible route never measured -> measure it;
3. a feasible route cheaper than the one rules 4-6 would pick, not tried for `remeasure_after`
   requests (doubling each time it is still too slow), or a dearer one, more rarely (its
   observed speed must age) -> re-measure it;
4. a feasible route `clearly_faster` than the one cost would pick (rules 5-6) -> take it;
5. the cheapest feasible route predicted to meet the objective (with `margin`);
6. default: the feasible route closest to the objective.

Edge-only is feasible only when the draft suffices (`Objective.draft_ok`) or the network is
down; thermal state `critical` rules out drafting while the cloud is reachable.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fedge.edge.draftlen import SpeculationEstimator


class Route(str, enum.Enum):
    """Where a request is decoded."""

    EDGE_ONLY = "edge-only"
    SPECULATIVE = "speculative"
    CLOUD_ONLY = "cloud-only"


EXPLORE_ORDER = (Route.EDGE_ONLY, Route.SPECULATIVE, Route.CLOUD_ONLY)  # cheapest first, a priori


class Thermal(str, enum.Enum):
    """The device's thermal state (the four levels phones report)."""

    NOMINAL = "nominal"
    FAIR = "fair"
    SERIOUS = "serious"
    CRITICAL = "critical"


THERMAL_FACTOR = {
    Thermal.NOMINAL: 1.0,
    Thermal.FAIR: 1.5,
    Thermal.SERIOUS: 3.0,
}  # critical: no drafting


@dataclass(frozen=True)
class Objective:
    """A request's service objective."""

    tokens_per_s: float = 15.0  # end to end; faster than people read code (about 5-8 tokens/s)
    ttft_s: float = 1.0  # an interactive answer starts within a second
    draft_ok: bool = False  # the draft's own output suffices (e.g. autocomplete), not the target's

    def __post_init__(self) -> None:
        for name in ("tokens_per_s", "ttft_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Objective.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class DeviceState:
    """What the device reports about itself; energies are inputs measured on the device."""

    battery: float = 1.0  # 0..1
    charging: bool = False
    thermal: Thermal = Thermal.NOMINAL
    joules_per_draft_token: float = 0.003  # about 1 ms of a 3 W phone SoC
    joules_per_byte: float = 1e-6  # radio energy, about 1 J per MB

    def __post_init__(self) -> None:
        if not 0.0 <= self.battery <= 1.0:
            raise ValueError(f"DeviceState.battery must lie in [0, 1], got {self.battery}")
        for name in ("joules_per_draft_token", "joules_per_byte"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeviceState.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def energy_weight(self) -> float:
        """How dear a joule is now: 1 when charging, 1/battery otherwise (floored at 5%)."""
        return 1.0 if self.charging else 1.0 / max(self.battery, 0.05)


@dataclass(frozen=True)
class RouterConfig:
    """Cost weights, learning and exploration of the router."""

    pass_cost: float = 1.0  # one target pass in the cloud: the unit of cost
    byte_cost: float = 1e-5  # 100 kB moved cost as much as one pass
    joule_cost: float = 10.0  # per device joule at full battery (3 mJ/token -> 0.03 passes)
    # weight of the newest outcome at the same RTT (more at another RTT: see Router.observe); low,
    # because one request's speed depends on its prompt (1-10 tokens per verify here)
    smoothing: float = 0.1
    margin: float = 1.1  # a prediction must beat the objective by 10% to count as meeting it
    remeasure_after: int = 16  # requests before a cheaper, too-slow route is tried again
    queue_capacity: int = 8  # verifier queue depth at which the cloud counts as twice as slow
    overload_factor: float = 4.0  # load multiplier right after RESOURCE_EXHAUSTED
    overload_cooldown_s: float = 5.0
    rtt_floor_s: float = 0.01  # RTTs are compared as (rtt + floor) ratios: 0 and 5 ms are alike
    rtt_moved: float = 2.0  # estimates made at an RTT this many times off are re-measured ...
    near_objective: float = 0.8  # ... when predicted within this share of the objective
    near_remeasure_after: int = 4  # requests before a cheaper route predicted near is tried again
    # at the same RTT one request counts as at most this many times slower than the estimate: a
    # prompt the draft cannot guess (1 token per verify) is not a slower route; one that really
    # slowed still moves the estimate request after request
    outlier: float = 2.0
    max_draft: int = 16  # the longest draft the speculative model may assume (DecodeConfig's)
    # a feasible route this many times faster than the one cost picks is taken instead: cost
    # decides between routes of about the same speed, speed when they differ clearly. Without
    # it (inf) a slower route won on cost whenever it met the objective: SmolLM2 at 20 ms
    # (bench/edge.py --preset smollm2), speculative 18.0 tokens/s against cloud-only 27.6
    # (1.53x), chosen for its 0.77 target passes a token, lost 38% of the speed
    clearly_faster: float = 1.25
    # weight kept by a route's earlier requests in its observed throughput at each new one
    # (about 5 requests of memory: a speed check, not the estimate of the objective's margin)
    observed_decay: float = 0.8

    def __post_init__(self) -> None:
        for name in ("pass_cost", "byte_cost", "joule_cost", "overload_cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RouterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"RouterConfig.smoothing must lie in (0, 1], got {self.smoothing}")
        if not self.clearly_faster > 1.0:
            raise ValueError(
                "RouterConfig.clearly_faster must be > 1 (inf: cost alone), got "
                f"{self.clearly_faster}"
            )
        if not 0.0 < self.observed_decay < 1.0:
            raise ValueError(
                f"RouterConfig.observed_decay must lie in (0, 1), got {self.observed_decay}"
            )
        if self.margin < 1.0 or self.overload_factor < 1.0 or self.outlier < 1.0:
            raise ValueError(
                "RouterConfig.margin, overload_factor and outlier must be >= 1, got "
                f"{self.margin}, {self.overload_factor}, {self.outlier}"
            )
        counts = ("remeasure_after", "near_remeasure_after", "queue_capacity", "max_draft")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"RouterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.rtt_floor_s <= 0 or self.rtt_moved <= 1 or not 0 < self.near_objective <= 1:
            raise ValueError(
                "RouterConfig needs rtt_floor_s > 0, rtt_moved > 1, 0 < near_objective <= 1, got "
                f"{self.rtt_floor_s}, {self.rtt_moved}, {self.near_objective}"
            )


@dataclass(frozen=True)
class Outcome:
    """What one request cost on its route: the client reports it after every request."""

    route: Route
    tokens: int
    seconds: float
    ttft_s: float
    passes: int = 0  # target forward passes in the cloud
    bytes: int = 0  # up + down
    round_trips: int = 0  # network round trips the edge waited on
    drafted: int = 0  # draft steps on the device
    cloud_seconds: float = 0.0  # time spent waiting on the verifier, network included
    rtt_s: float = 0.0  # the RTT when the request ran


@dataclass
class Throughput:
    """A route's tokens per second as observed on one network: decayed sums of its requests'
    tokens and seconds (`RouterConfig.observed_decay`) and the token-weighted RTT they ran at.
    No model stands between these figures and the route's speed: they are what its requests
    took, slow prompts included. A request at an RTT `rtt_moved` times away starts them afresh
    (another network's speed says nothing measured about this one's)."""

    tokens: float = 0.0
    seconds: float = 0.0
    rtt_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Observed tokens per second (0 before any request)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float, rtt_s: float, keep: float) -> None:
        """Fold one request in, the earlier ones weighted by `keep`."""
        kept = keep * self.tokens
        self.rtt_s = (kept * self.rtt_s + tokens * rtt_s) / (kept + tokens)
        self.tokens = kept + tokens
        self.seconds = keep * self.seconds + seconds


@dataclass
class RouteStats:
    """Running estimates of one route, per token unless named otherwise."""

    n: int = 0
    last_request: int = -1
    seconds: float = 0.0
    ttft_s: float = 0.0
    passes: float = 0.0
    bytes: float = 0.0
    drafted: float = 0.0
    round_trips: float = 0.0
    cloud_share: float = 0.0
    rtt_s: float = 0.0
    backoff: int = 1  # re-measurement period multiplier: doubles while the route stays too slow
    observed: Throughput = field(default_factory=Throughput)  # its speed on this network


@dataclass(frozen=True)
class Prediction:
    """A route's expected tokens/s, TTFT and cost per token now."""

    tokens_per_s: float
    ttft_s: float
    cost: float

    def meets(self, objective: Objective, margin: float = 1.0) -> bool:
        """Whether the prediction clears the objective by `margin`."""
        return (
            self.tokens_per_s >= objective.tokens_per_s * margin
            and self.ttft_s * margin <= objective.ttft_s
        )

    def attainment(self, objective: Objective) -> float:
        """The worse of the two ratios to the objective (>= 1 means met)."""
        return min(self.tokens_per_s / objective.tokens_per_s, objective.ttft_s / self.ttft_s)


@dataclass(frozen=True)
class Decision:
    """A route, why it was chosen, and the predictions it was chosen from."""

    route: Route
    reason: str
    predicted: dict[Route, Prediction]


@dataclass
class RouterState:
    """Everything the policies read: estimates, the network, the verifier and the device."""

    config: RouterConfig
    stats: dict[Route, RouteStats] = field(default_factory=lambda: {r: RouteStats() for r in Route})
    rtt_s: float = 0.0
    verifier_up: bool = True
    queue_depth: int = 0
    overloaded_at: float = -math.inf
    requests: int = 0
    in_use: Route | None = None  # the route of the last request that taught the router
    clock: Callable[[], float] = time.monotonic
    speculation: SpeculationEstimator = field(default_factory=SpeculationEstimator)

    def load(self) -> float:
        """Cloud slowdown and dearness: 1 idle, +1 per `queue_capacity` queued, more when overloaded."""
        load = 1.0 + self.queue_depth / self.config.queue_capacity
        if self.clock() - self.overloaded_at < self.config.overload_cooldown_s:
            load *= self.config.overload_factor
        return load

    def rtt_similarity(self, a_s: float, b_s: float | None = None) -> float:
        """How alike two RTTs are (`b_s` default: the current one): 1 equal, towards 0 far apart."""
        floor = self.config.rtt_floor_s
        b_s = self.rtt_s if b_s is None else b_s
        low, high = sorted((a_s + floor, b_s + floor))
        return low / high

    def rtt_moved(self, a_s: float, b_s: float | None = None) -> bool:
        """Whether two RTTs (`b_s` default: the current one) are `rtt_moved` times apart or more."""
        return self.rtt_similarity(a_s, b_s) * self.config.rtt_moved <= 1.0

    def observed_speed(self, route: Route) -> float | None:
        """The route's tokens/s as observed on the current network, its cloud share slowed by
        the load now as a prediction is; None when it has not run on this network."""
        s = self.stats[route]
        if s.observed.seconds <= 0 or self.rtt_moved(s.observed.rtt_s):
            return None
        return s.observed.tokens_per_s / (1.0 + (self.load() - 1.0) * s.cloud_share)


def speculative_shift(state: RouterState, s: RouteStats) -> tuple[float, float, float]:
    """What speculative decoding gains or loses per token (seconds, target passes) and in TTFT
    going from the RTT its estimates were measured at to the current one, by the draft-length
    model (fedge.edge.draftlen): the draft grows with the RTT, so each token pays less of it."""
    est, hi = state.speculation, state.config.max_draft
    then_g, now_g = est.best_draft_len(1, hi, s.rtt_s), est.best_draft_len(1, hi, state.rtt_s)
    seconds = est.seconds_per_token(1, hi, state.rtt_s) - est.seconds_per_token(1, hi, s.rtt_s)
    passes = 1 / est.expected_tokens(now_g) - 1 / est.expected_tokens(then_g)
    ttft = state.rtt_s - s.rtt_s + (now_g - then_g) * est.draft_step_s
    return seconds, passes, ttft


def predict(state: RouterState, route: Route, device: DeviceState) -> Prediction | None:
    """The route's tokens/s, TTFT and cost at the current RTT, load and device state."""
    s = state.stats[route]
    if s.n == 0:
        return None
    cfg = state.config
    slow = 1.0 + (state.load() - 1.0) * s.cloud_share
    passes = s.passes
    if route == Route.SPECULATIVE and state.speculation.verifies:
        shift, more_passes, later = speculative_shift(state, s)
        seconds = max(1e-6, s.seconds + shift) * slow
        ttft = max(1e-6, s.ttft_s + later) * slow
        passes = max(0.0, passes + more_passes)
    else:
        # Each round trip costs the RTT difference to the one measured with the estimates; a
        # shorter RTT removes at most the time actually spent waiting (a ping can overstate it).
        # At the RTT they were measured at the prediction is the measurement: it once removed
        # the capped wait and added back the whole RTT, so an overstated ping (round trips x RTT
        # beyond the time waited) made a route predict slower where it had just run
        moved = state.rtt_s - s.rtt_s
        later = max(moved * s.round_trips, -s.cloud_share * s.seconds)
        seconds = max(1e-6, s.seconds + later) * slow
        first = max(moved, -s.cloud_share * s.ttft_s) if s.round_trips else 0.0
        ttft = max(1e-6, s.ttft_s + first) * slow
    joules = s.bytes * device.joules_per_byte
    if s.drafted:  # drafting heats the device: dearer when warm, ruled out (inf) when critical
        joules += (
            s.drafted * device.joules_per_draft_token * THERMAL_FACTOR.get(device.thermal, math.inf)
        )
    cost = (
        cfg.pass_cost * state.load() * passes
        + cfg.byte_cost * s.bytes
        + cfg.joule_cost * device.energy_weight * joules
    )
    return Prediction(1.0 / seconds, ttft, cost)


def speeds(state: RouterState, predicted: dict[Route, Prediction]) -> dict[Route, float]:
    """Each predicted route's tokens/s: as observed on this network where it ran here (the
    check on the model), else as the model predicts it."""
    return {
        r: observed if (observed := state.observed_speed(r)) is not None else p.tokens_per_s
        for r, p in predicted.items()
    }


def feasible(state: RouterState, objective: Objective, device: DeviceState) -> list[Route]:
    """Routes allowed now: edge-only only when the draft suffices, no drafting when critical."""
    hot = device.thermal == Thermal.CRITICAL
    routes = [Route.CLOUD_ONLY] if hot else [Route.SPECULATIVE, Route.CLOUD_ONLY]
    if objective.draft_ok and not hot:
        routes.insert(0, Route.EDGE_ONLY)
    return routes


@dataclass(frozen=True)
class Context:
    """One routing question: the state, the request's objective, the device, the predictions."""

    state: RouterState
    objective: Objective
    device: DeviceState
    routes: list[Route]
    predicted: dict[Route, Prediction]
    speeds: dict[Route, float] = field(default_factory=dict)  # `speeds()`; default: predictions

    def speed(self, route: Route) -> float:
        """The route's tokens/s: observed on this network, else predicted."""
        return self.speeds.get(route, self.predicted[route].tokens_per_s)

    def meeting(self) -> list[Route]:
        """Feasible routes predicted to meet the objective, cheapest first: by `margin`, except
        the route in use, which keeps its place while it is predicted to meet it at all
        (hysteresis: one slow prompt does not abandon a route that is meeting the objective)."""
        state = self.state
        ok = [r for r in self.routes if r in self.predicted]
        ok = [
            r
            for r in ok
            if self.predicted[r].meets(
                self.objective, 1.0 if r == state.in_use else state.config.margin
            )
        ]
        return sorted(ok, key=lambda r: self.predicted[r].cost)

    def by_cost(self) -> Route:
        """The route cost picks: the cheapest meeting the objective, else the closest to it."""
        meeting = self.meeting()
        if meeting:
            return meeting[0]
        return max(self.routes, key=lambda r: self.predicted[r].attainment(self.objective))

    def clearly_faster(self, route: Route) -> Route | None:
        """The fastest feasible route `clearly_faster` times faster than `route`, if any (one
        meeting the objective when `route` meets it: speed does not buy a missed TTFT)."""
        meeting = self.meeting()
        rivals = meeting if route in meeting else self.routes
        fastest = max(rivals, key=self.speed)
        if self.speed(fastest) >= self.state.config.clearly_faster * self.speed(route):
            return fastest
        return None

    def outpaced(self, route: Route) -> bool:
        """Whether some feasible route is `clearly_faster` times faster than `route`."""
        fastest = max(self.speed(r) for r in self.routes)
        return fastest >= self.state.config.clearly_faster * self.speed(route)

    def pick(self) -> Route:
        """The route rules 4-6 choose: cost's, unless another is clearly faster."""
        route = self.by_cost()
        return self.clearly_faster(route) or route


Policy = Callable[[Context], tuple[Route, str] | None]


def policy_network_down(ctx: Context) -> tuple[Route, str] | None:
    """No verifier reachable: the draft alone answers."""
    if not ctx.state.verifier_up:
        return Route.EDGE_ONLY, "verifier unreachable: decoding on the device"
    return None


def policy_untried(ctx: Context) -> tuple[Route, str] | None:
    """Measure a feasible route that has no estimate yet, cheapest a priori first."""
    for route in EXPLORE_ORDER:
        if route in ctx.routes and route not in ctx.predicted:
            return route, f"measuring {route.value}"
    return None


def policy_remeasure(ctx: Context) -> tuple[Route, str] | None:
    """Try again a route cheaper than the one rules 4-6 pick, which looked too slow (short of
    the objective, or clearly slower than another): a while ago (sooner when predicted near the
    objective and not clearly slower: one slow prompt may have put it there), or at once when
    measured at a quite different RTT and now predicted near the objective. A dearer route is
    tried again after `remeasure_after` requests times its backoff (doubling each time it is
    still not the pick): it could have become clearly faster."""
    pick = ctx.pick()
    ceiling = ctx.predicted[pick].cost if pick in ctx.meeting() else math.inf
    state, cfg = ctx.state, ctx.state.config
    for route in sorted(ctx.routes, key=lambda r: ctx.predicted[r].cost):
        if route == pick or ctx.predicted[route].cost >= ceiling:
            continue
        s = state.stats[route]
        near = ctx.predicted[route].attainment(ctx.objective) >= cfg.near_objective
        near = near and not ctx.outpaced(route)
        period = cfg.near_remeasure_after if near else cfg.remeasure_after
        if state.requests - s.last_request >= period * s.backoff:
            return route, f"re-measuring {route.value} (not tried for a while)"
        if near and state.rtt_moved(s.rtt_s):
            return route, f"re-measuring {route.value} (measured at another RTT, predicted near)"
    for route in ctx.routes:  # dearer ones too, more rarely: else their speed would never age
        s = state.stats[route]
        if route == pick or ctx.predicted[route].cost < ceiling:
            continue
        if state.requests - s.last_request >= cfg.remeasure_after * s.backoff:
            return route, f"re-measuring {route.value} (dearer; not tried for a while)"
    return None


def policy_clearly_faster(ctx: Context) -> tuple[Route, str] | None:
    """A route clearly faster than the one cost would pick: speed wins when the gap is large."""
    cheap = ctx.by_cost()
    fast = ctx.clearly_faster(cheap)
    if fast is None:
        return None
    how = [
        "observed" if ctx.state.observed_speed(r) is not None else "predicted"
        for r in (fast, cheap)
    ]
    return fast, (
        f"{fast.value} clearly faster than {cheap.value}: {ctx.speed(fast):.1f} ({how[0]}) "
        f"against {ctx.speed(cheap):.1f} ({how[1]}) tokens/s"
    )


def policy_cheapest_meeting(ctx: Context) -> tuple[Route, str] | None:
    """The cheapest feasible route predicted to meet the objective."""
    meeting = ctx.meeting()
    if meeting:
        return meeting[0], "cheapest route meeting the objective"
    return None


def policy_closest(ctx: Context) -> tuple[Route, str] | None:
    """Default: no route meets the objective; take the one closest to it."""
    best = max(ctx.routes, key=lambda r: ctx.predicted[r].attainment(ctx.objective))
    return best, "no route meets the objective: closest one"


POLICIES: tuple[Policy, ...] = (
    policy_network_down,
    policy_untried,
    policy_remeasure,
    policy_clearly_faster,
    policy_cheapest_meeting,
    policy_closest,  # default: always decides
)


class Router:
    """Chooses a route per request and learns from each request's outcome."""

    def __init__(
        self,
        config: RouterConfig | None = None,
        policies: tuple[Policy, ...] = POLICIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = RouterState(config or RouterConfig(), clock=clock)
        self.policies = policies
        self.device = DeviceState()

    @property
    def speculation(self) -> SpeculationEstimator:
        """The draft-length model, shared by every request's decoder and read by predictions."""
        return self.state.speculation

    def choose(self, objective: Objective | None = None) -> Decision:
        """First policy that decides wins."""
        objective = objective or Objective()
        routes = feasible(self.state, objective, self.device)
        predicted = {r: p for r in Route if (p := predict(self.state, r, self.device)) is not None}
        ctx = Context(
            self.state, objective, self.device, routes, predicted, speeds(self.state, predicted)
        )
        for policy in self.policies:
            decided = policy(ctx)
            if decided is not None:
                return Decision(decided[0], decided[1], predicted)
        names = [p.__name__ for p in self.policies]
        raise RuntimeError(f"no routing policy decided; the chain {names} needs a default last")

    def observe(self, outcome: Outcome, objective: Objective | None = None) -> None:
        """Fold one request's outcome into its route's estimates."""
        state, s = self.state, self.state.stats[outcome.route]
        state.requests += 1
        if outcome.tokens < 1 or outcome.seconds <= 0:
            return  # nothing was decoded: no rate to learn
        n = outcome.tokens
        per_token = {
            "seconds": outcome.seconds / n,
            "passes": outcome.passes / n,
            "bytes": outcome.bytes / n,
            "drafted": outcome.drafted / n,
            "round_trips": outcome.round_trips / n,
        }
        # an outcome at another RTT replaces more of the old estimates than one at the same RTT
        similar = state.rtt_similarity(s.rtt_s, outcome.rtt_s)
        a = 1.0 if s.n == 0 else 1.0 - (1.0 - state.config.smoothing) * similar
        if s.n and similar >= 0.5:  # same network: a very slow request is news about its prompt
            per_token["seconds"] = min(per_token["seconds"], state.config.outlier * s.seconds)
        for name, value in per_token.items():
            setattr(s, name, (1 - a) * getattr(s, name) + a * value)
        s.ttft_s = (1 - a) * s.ttft_s + a * outcome.ttft_s
        s.cloud_share = (1 - a) * s.cloud_share + a * min(
            1.0, outcome.cloud_seconds / outcome.seconds
        )
        s.rtt_s = (1 - a) * s.rtt_s + a * outcome.rtt_s
        s.n += 1
        s.last_request = state.requests
        state.in_use = outcome.route
        self._observe_throughput(s.observed, outcome)
        # the estimates, not this one request, say whether the route is far from the objective
        # or clearly slower than another, or (a dearer route) still not the pick: only then
        # does its re-measurement back off
        goal = objective or Objective()
        attained = min(1.0 / s.seconds / goal.tokens_per_s, goal.ttft_s / max(s.ttft_s, 1e-9))
        near = attained >= state.config.near_objective
        ctx = self._context(goal)
        if outcome.route in ctx.predicted:
            pick = ctx.pick()
            dearer = outcome.route != pick and (
                pick in ctx.meeting()
                and ctx.predicted[outcome.route].cost >= ctx.predicted[pick].cost
            )
            near = near and not dearer and not ctx.outpaced(outcome.route)
        s.backoff = 1 if near else min(64, s.backoff * 2)

    def _observe_throughput(self, t: Throughput, outcome: Outcome) -> None:
        """Fold a request into its route's observed throughput, afresh on another network. No
        `outlier` cap here: capping slow requests and not fast ones biased it upwards (the
        micro zoo at 0 ms: speculative held at ~900 tokens/s, its prompts making 360-400,
        against cloud-only's 714, so never clearly slower); a slow prompt is part of the
        route's speed, and `clearly_faster` leaves room for one."""
        keep = self.state.config.observed_decay
        if t.tokens <= 0 or self.state.rtt_moved(t.rtt_s, outcome.rtt_s):
            keep = 0.0
        t.add(outcome.tokens, outcome.seconds, outcome.rtt_s, keep)

    def _context(self, objective: Objective) -> Context:
        """The routing question now, over the feasible routes measured so far."""
        routes = feasible(self.state, objective, self.device)
        predicted = {r: p for r in routes if (p := predict(self.state, r, self.device)) is not None}
        return Context(
            self.state,
            objective,
            self.device,
            list(predicted),
            predicted,
            speeds(self.state, predicted),
        )

    def observe_rtt(self, seconds: float) -> None:
        """A measured round trip (health check, recent calls): the verifier is reachable. The
        network's alone: the verifier's compute is in each route's estimates (cloud-only's seconds
        per token, a verify call's cost beyond the RTT in `SpeculationEstimator`), so a round trip
        that counted it (a prompt's prefill) would be charged twice (`fedge.edge.client.transport`)."""
        self.state.rtt_s = seconds
        self.state.verifier_up = True
        self.state.speculation.observe_rtt(seconds)

    def observe_queue_depth(self, depth: int) -> None:
        """The verifier's queue depth, as its replies or metrics report it."""
        self.state.queue_depth = max(0, depth)

    def observe_overload(self) -> None:
        """The verifier answered RESOURCE_EXHAUSTED: the cloud is dear for a cooldown."""
        self.state.overloaded_at = self.state.clock()

    def verifier_down(self) -> None:
        """The verifier could not be reached (or health says NOT_SERVING)."""
        self.state.verifier_up = False
