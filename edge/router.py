"""Adaptive offload: per request, decode on the edge only, speculatively, or in the cloud only.

The router keeps running estimates (exponentially weighted) of the network
round trip, the draft's step time, the verifier's time per pass, the cloud's
time per streamed token and the acceptance rate, and predicts each route's
tokens per second for the next request:

    speculative  E(a, g) / (g * t_draft + rtt + t_verify),  E = (1 - a^(g+1)) / (1 - a)
    cloud-only   n / (rtt + n * t_cloud)   (one round trip, then a stream of n tokens)
    edge-only    1 / t_draft               (the draft's own output: a different distribution)

Policies are tried in order, first match wins, the default last (see POLICIES).
Speculation always saves cloud capacity (about 1/E target passes per token);
under the "capacity" objective the router keeps speculating unless that would
be more than `capacity_slack` times slower than cloud-only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from edge.speculative import expected_tokens_per_pass


class Route(str, enum.Enum):
    """Where the next request is decoded."""

    EDGE_ONLY = "edge-only"
    SPECULATIVE = "speculative"
    CLOUD_ONLY = "cloud-only"


OBJECTIVES = ("latency", "capacity")


@dataclass(frozen=True)
class RouterConfig:
    """The router's objective and its smoothing."""

    objective: str = "latency"  # latency: fastest exact route; capacity: spare the cloud's passes
    allow_edge_only: bool = False  # edge-only output is the draft's, not the target's
    capacity_slack: float = 1.5
    smoothing: float = 0.3  # weight of the newest observation in each running estimate
    new_tokens: int = 64  # request length the cloud-only estimate assumes

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"RouterConfig.objective must be one of {OBJECTIVES}, got {self.objective!r}"
            )
        if self.capacity_slack < 1.0:
            raise ValueError(f"RouterConfig.capacity_slack must be >= 1, got {self.capacity_slack}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"RouterConfig.smoothing must lie in (0, 1], got {self.smoothing}")
        if self.new_tokens < 1:
            raise ValueError(f"RouterConfig.new_tokens must be >= 1, got {self.new_tokens}")


@dataclass
class LinkEstimates:
    """Running measurements the policies read; None = not measured yet."""

    rtt_s: float | None = None
    draft_step_s: float | None = None
    verify_s: float | None = None  # verifier time per pass, network excluded
    cloud_token_s: float | None = None  # cloud streaming time per token, network excluded
    acceptance: float | None = None
    draft_len: int = 4
    verifier_up: bool = True


@dataclass(frozen=True)
class Decision:
    """A route, why it was chosen, and the predicted tokens/s of each route."""

    route: Route
    reason: str
    predicted: dict[str, float]


def predict(est: LinkEstimates, new_tokens: int) -> dict[str, float]:
    """Predicted tokens/s per route from the estimates (routes lacking a measurement are absent)."""
    out: dict[str, float] = {}
    rtt = est.rtt_s or 0.0
    if est.draft_step_s:
        out[Route.EDGE_ONLY.value] = 1.0 / est.draft_step_s
    if est.draft_step_s is not None and est.verify_s is not None and est.acceptance is not None:
        g = est.draft_len
        round_s = g * est.draft_step_s + rtt + est.verify_s
        out[Route.SPECULATIVE.value] = expected_tokens_per_pass(est.acceptance, g) / round_s
    if est.cloud_token_s is not None:
        out[Route.CLOUD_ONLY.value] = new_tokens / (rtt + new_tokens * est.cloud_token_s)
    return out


Policy = Callable[[LinkEstimates, RouterConfig, dict[str, float]], Decision | None]


def policy_offline(
    est: LinkEstimates, cfg: RouterConfig, pred: dict[str, float]
) -> Decision | None:
    """No verifier reachable: the draft alone is the only way to answer."""
    if not est.verifier_up:
        return Decision(Route.EDGE_ONLY, "verifier unreachable", pred)
    return None


def policy_explore(
    est: LinkEstimates, cfg: RouterConfig, pred: dict[str, float]
) -> Decision | None:
    """Measure an unmeasured exact route before comparing: speculative first, then cloud-only."""
    if Route.SPECULATIVE.value not in pred:
        return Decision(Route.SPECULATIVE, "measuring speculative decoding", pred)
    if Route.CLOUD_ONLY.value not in pred:
        return Decision(Route.CLOUD_ONLY, "measuring cloud-only decoding", pred)
    return None


def policy_edge_allowed(
    est: LinkEstimates, cfg: RouterConfig, pred: dict[str, float]
) -> Decision | None:
    """When the draft's own output is acceptable and it is the fastest, stay on the device."""
    edge = pred.get(Route.EDGE_ONLY.value)
    if cfg.allow_edge_only and edge is not None and edge >= max(pred.values()):
        return Decision(Route.EDGE_ONLY, "edge-only allowed and fastest", pred)
    return None


def policy_capacity(
    est: LinkEstimates, cfg: RouterConfig, pred: dict[str, float]
) -> Decision | None:
    """Spare cloud passes: speculate unless more than `capacity_slack` times slower than the cloud."""
    if cfg.objective != "capacity":
        return None
    spec, cloud = pred[Route.SPECULATIVE.value], pred[Route.CLOUD_ONLY.value]
    if spec * cfg.capacity_slack >= cloud:
        return Decision(Route.SPECULATIVE, "capacity objective: speculation within slack", pred)
    return Decision(Route.CLOUD_ONLY, "capacity objective: speculation too slow", pred)


def policy_latency(
    est: LinkEstimates, cfg: RouterConfig, pred: dict[str, float]
) -> Decision | None:
    """The faster of the two exact routes."""
    spec, cloud = pred[Route.SPECULATIVE.value], pred[Route.CLOUD_ONLY.value]
    if cloud > spec:
        return Decision(Route.CLOUD_ONLY, "cloud-only predicted faster", pred)
    return Decision(Route.SPECULATIVE, "speculative predicted faster", pred)


POLICIES: tuple[Policy, ...] = (
    policy_offline,
    policy_explore,
    policy_edge_allowed,
    policy_capacity,
    policy_latency,  # default: always decides
)


class Router:
    """Chooses a route per request and learns from each request's measurements."""

    def __init__(
        self, config: RouterConfig | None = None, policies: tuple[Policy, ...] = POLICIES
    ) -> None:
        self.config = config or RouterConfig()
        self.policies = policies
        self.estimates = LinkEstimates()

    def choose(self) -> Decision:
        """First policy that decides wins."""
        pred = predict(self.estimates, self.config.new_tokens)
        for policy in self.policies:
            decision = policy(self.estimates, self.config, pred)
            if decision is not None:
                return decision
        names = [p.__name__ for p in self.policies]
        raise RuntimeError(f"no routing policy decided; the chain {names} needs a default last")

    def _blend(self, old: float | None, new: float) -> float:
        """Exponentially weighted running estimate."""
        a = self.config.smoothing
        return new if old is None else (1 - a) * old + a * new

    def observe_rtt(self, seconds: float) -> None:
        """A measured network round trip."""
        self.estimates.rtt_s = self._blend(self.estimates.rtt_s, seconds)
        self.estimates.verifier_up = True

    def observe_speculative(
        self, draft_step_s: float, verify_s: float, acceptance: float, draft_len: int
    ) -> None:
        """One speculative request: draft step time, verifier time per pass, acceptance, last draft length."""
        e = self.estimates
        e.draft_step_s = self._blend(e.draft_step_s, draft_step_s)
        e.verify_s = self._blend(e.verify_s, verify_s)
        e.acceptance = self._blend(e.acceptance, acceptance)
        e.draft_len = max(1, draft_len)

    def observe_cloud(self, token_s: float) -> None:
        """One cloud-only request: streaming time per token, network excluded."""
        self.estimates.cloud_token_s = self._blend(self.estimates.cloud_token_s, token_s)

    def observe_edge(self, draft_step_s: float) -> None:
        """One edge-only request: the draft's time per token."""
        self.estimates.draft_step_s = self._blend(self.estimates.draft_step_s, draft_step_s)

    def verifier_down(self) -> None:
        """The verifier could not be reached."""
        self.estimates.verifier_up = False
