"""The accounting every DP strategy wrapper shares: refuse an over-budget release, report epsilon.

A DP wrapper (:class:`fedge.server.privacy.strategy.CentralDP`, or
:class:`fedge.server.secagg.strategy.SecAggPlus` with ``dp=DistributedDP(...)``) asks
:meth:`ReleaseAccount.admit` before a round's train messages leave, and calls
:meth:`ReleaseAccount.record` once the round's noised sum is released. ``record`` returns the
metrics Flower's ``Strategy.start`` files under ``Result.train_metrics_clientapp[round]``, so a
run's ``Result`` carries its epsilon round by round; every release is also logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from flwr.app import MetricRecord
from flwr.serverapp.exception import PrivacyBudgetExhausted

from fedge.privacy.accounting import METHODS, Method, gaussian_epsilon
from fedge.server.privacy.accountant import DPBudget
from fedge.server.privacy.config import DPConfig

log = logging.getLogger(__name__)

# Keys of the metrics a DP wrapper adds to each round's train MetricRecord (Flower's Result).
MET_EPSILON = "dp-epsilon"  # cumulative user-level epsilon of the released rounds
MET_DELTA = "dp-delta"  # the delta it is computed at
MET_NOISE = "dp-noise-multiplier"  # z of this round's release
MET_CLIP = "dp-clip-norm"  # C this round's updates were clipped to
MET_UNCLIPPED = "dp-unclipped-fraction"  # adaptive clipping: the noised fraction under C
MET_EXHAUSTED = "dp-budget-exhausted"  # 1: this round was refused, its release would overspend

OnBudget = Literal["stop", "raise"]
Metrics = dict[str, int | float | list[int] | list[float]]  # what a MetricRecord holds


@dataclass(frozen=True)
class DistributedDP:
    """Distributed DP for :class:`fedge.server.secagg.strategy.SecAggPlus` (one object).

    Every client clips its update (adapter delta and SCAFFOLD's control delta jointly) to
    ``clip_norm`` C and adds N(0, (z C)^2 / m) before SecAgg+ masks it, with m =
    ceil(``min_survival`` x sampled): the round is abandoned below m contributors, so every
    released sum carries noise of std >= z C and the server never sees an un-noised update.
    ``max_epsilon`` (0: no cap) refuses a round whose release would pass it, at
    ``target_delta``, with the ``accountant`` (``rdp``, or ``pld``, tighter). The client half
    is ``fedge.clients.mods.dispatch_mods`` (it runs the noise mod whenever the message asks).
    """

    noise_multiplier: float = 1.0
    clip_norm: float = 1.0
    target_delta: float = 1e-5
    max_epsilon: float = 0.0
    accountant: Method = "rdp"
    min_survival: float = 0.8
    on_budget: OnBudget = "stop"

    def __post_init__(self) -> None:
        """Validate through :class:`DPConfig`, which names the field."""
        self.config()
        check_on_budget(self.on_budget)

    def config(self) -> DPConfig:
        """The aggregator's settings."""
        return DPConfig(
            mode="distributed",
            clip_norm=self.clip_norm,
            noise_multiplier=self.noise_multiplier,
            target_delta=self.target_delta,
            max_epsilon=self.max_epsilon,
            accountant=self.accountant,
            min_survival=self.min_survival,
        )


def check_on_budget(on_budget: str) -> None:
    """``on_budget`` must be ``stop`` (no more rounds, the Result kept) or ``raise``."""
    if on_budget not in ("stop", "raise"):
        raise ValueError(
            f"on_budget={on_budget!r}: use 'stop' (refuse every further round, keep the "
            "Result) or 'raise' (Flower's PrivacyBudgetExhausted ends the ServerApp)"
        )


class ReleaseAccount:
    """One Gaussian release per round (noise multiplier z, sensitivity C), accounted by
    :class:`DPBudget` (dp-accounting's RDP or PLD, no amplification by sampling claimed:
    Flower's sampling is not secret)."""

    def __init__(self, cfg: DPConfig, on_budget: OnBudget = "stop") -> None:
        check_on_budget(on_budget)
        if cfg.accountant not in METHODS:
            raise ValueError(f"accountant={cfg.accountant!r}: use one of {', '.join(METHODS)}")
        self.cfg = cfg
        self.on_budget = on_budget
        self.budget = DPBudget(cfg)
        self.exhausted_at: int | None = None  # the first round refused for the budget

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far at ``cfg.target_delta`` (0.0 before the first release)."""
        return self.budget.epsilon()

    @property
    def releases(self) -> int:
        """Rounds released so far."""
        return int(self.budget.state()["releases"])

    def admit(self, server_round: int) -> bool:
        """Whether ``server_round`` may release; False (or Flower's ``PrivacyBudgetExhausted``
        with ``on_budget="raise"``) when its release would take epsilon past ``max_epsilon``.
        Once refused, every later round is refused too."""
        if self.exhausted_at is not None:
            return False
        if self.budget.allows(server_round):
            return True
        nxt = gaussian_epsilon(
            [self.cfg.noise_multiplier] * (self.releases + 1),
            self.cfg.target_delta,
            self.cfg.accountant,
        )
        reason = (
            f"round {server_round}: its release would bring epsilon from {self.epsilon:.4g} to "
            f"{nxt:.4g} (delta {self.cfg.target_delta:g}, {self.cfg.accountant}), above "
            f"max_epsilon {self.cfg.max_epsilon:g}; no train message is sent"
        )
        if self.on_budget == "raise":
            raise PrivacyBudgetExhausted(reason)
        log.warning(
            "%s, nor in any later round: the model stays that of round %d", reason, server_round - 1
        )
        self.exhausted_at = server_round
        return False

    def record(self, server_round: int, clip_norm: float | None = None) -> Metrics:
        """Account ``server_round``'s release; return the round's DP metrics (and log them)."""
        self.budget.record(server_round, 1, 0)
        clip = self.cfg.clip_norm if clip_norm is None else clip_norm
        log.info(
            "round %d: DP release %d, z %.4g, C %.4g: epsilon %.4f at delta %g (%s)",
            server_round,
            self.releases,
            self.cfg.noise_multiplier,
            clip,
            self.epsilon,
            self.cfg.target_delta,
            self.cfg.accountant,
        )
        return {
            MET_EPSILON: self.epsilon,
            MET_DELTA: self.cfg.target_delta,
            MET_NOISE: self.cfg.noise_multiplier,
            MET_CLIP: clip,
        }

    def refused(self) -> MetricRecord:
        """The metrics of a round refused for the budget: the unchanged epsilon and the flag."""
        return MetricRecord(
            {MET_EPSILON: self.epsilon, MET_DELTA: self.cfg.target_delta, MET_EXHAUSTED: 1.0}
        )


def finite_positive(name: str, value: float) -> float:
    """``value`` if finite and > 0, else a ValueError naming ``name``."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value}: must be finite and > 0")
    return float(value)
