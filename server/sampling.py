"""Cohort sampling the accountant can trust: Poisson or fixed-size, secret, from the eligible.

With ``privacy-sampling`` set, the round loop draws its cohort exactly as a subsampled
Gaussian accountant assumes, and :class:`SampledDPBudget` accounts each round with the
rate it was drawn at (dp-accounting's subsampled events):

``poisson``
    every eligible node joins independently with probability q = K / n (n: the nodes
    eligible this round, K: the reports wanted); the cohort's size varies. Neighbouring
    datasets add or remove one client, whose clipped update moves the noised sum by at
    most C: ``PoissonSampledDpEvent(q, Gaussian(z))``, under RDP or PLD.
``fixed``
    exactly K of the n eligible nodes, uniformly without replacement. The accountant for
    this (Wang, Balle and Kasiviswanathan 2019) is stated for replace-one neighbours, where
    one client's swap moves the sum by up to 2C, so the noise multiplier it sees is z / 2:
    ``SampledWithoutReplacementDpEvent(n, K, Gaussian(z / 2))``, RDP only.

The draw uses the operating system's randomness, never the run's seed (an adversary who
knows the seed knows the cohort, and amplification is gone). Consequences, stated in
docs/phones.md: the amplified epsilon protects against whoever sees the released adapters,
not against the server that ran the draw (it knows the cohort: against it, the
unamplified epsilon of :func:`fedge.privacy.accounting.gaussian_epsilon` holds); a resumed
run draws fresh cohorts; over-selection is refused (keeping the first K reports by
arrival would choose by speed, not by the coin).
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedge.extras import require
from fedge.types import ConfigValue

if TYPE_CHECKING:
    from fedge.server.config import RunConfig
    from fedge.server.privacy.config import DPConfig

KEY_SAMPLING = "privacy-sampling"  # "" (the loop's seeded order), "poisson" or "fixed"
SCHEMES = ("", "poisson", "fixed")


@dataclass(frozen=True)
class Draw:
    """How one round's cohort was drawn: scheme, nodes eligible, size wanted, rate."""

    scheme: str
    eligible: int  # n: nodes the cohort was drawn from
    wanted: int  # K: fixed size, or the expected size of a Poisson draw
    sampled: tuple[int, ...]

    @property
    def rate(self) -> float:
        """q = K / n, each eligible node's chance to be in the cohort."""
        return min(1.0, self.wanted / self.eligible) if self.eligible else 0.0


def sampling_scheme(extra: Mapping[str, ConfigValue], over_selection: float) -> str:
    """The configured scheme ("" when unset); refuse unknown names and over-selection with one."""
    scheme = str(extra.get(KEY_SAMPLING, ""))
    if scheme not in SCHEMES:
        raise ValueError(
            f"{KEY_SAMPLING}={scheme!r}: use 'poisson' or 'fixed' (or leave it unset for the "
            "loop's own seeded sampling, accounted without amplification)"
        )
    if scheme and over_selection > 0:
        raise ValueError(
            f"{KEY_SAMPLING}={scheme!r} with over-selection={over_selection}: keeping the "
            "first K reports by arrival picks by speed, which no accountant models; set "
            "over-selection = 0"
        )
    return scheme


def draw_cohort(
    scheme: str, candidates: Sequence[int], wanted: int, rng: np.random.Generator | None = None
) -> Draw:
    """Draw from ``candidates`` (the nodes eligible now) by ``scheme``, with secret randomness."""
    if scheme not in ("poisson", "fixed"):
        raise ValueError(f"draw_cohort needs 'poisson' or 'fixed', got {scheme!r}")
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    n, k = len(candidates), min(wanted, len(candidates))
    if scheme == "fixed":
        picks = np.sort(rng.choice(n, size=k, replace=False)) if k else np.empty(0, np.int64)
    else:
        picks = np.flatnonzero(rng.random(n) < (k / n if n else 0.0))
    return Draw(scheme, n, k, tuple(int(candidates[i]) for i in picks))


class SampledDPBudget:
    """The round loop's privacy budget, amplified by the cohort sampling each round used.

    ``noise_multiplier`` z and the accountant (``rdp`` or ``pld``) are the DP aggregator's;
    every round records its :class:`Draw`. ``allows_draw`` prices a drawn round before it is
    released, so a stop comes before an overspend.
    """

    def __init__(
        self, noise_multiplier: float, delta: float, method: str, max_epsilon: float, scheme: str
    ) -> None:
        if scheme == "fixed" and method != "rdp":
            raise ValueError(
                f"{KEY_SAMPLING}='fixed' is accounted by RDP only (dp-accounting has no PLD for "
                "sampling without replacement): set dp-accountant = 'rdp', or use 'poisson'"
            )
        self.z, self.delta, self.method = noise_multiplier, delta, method
        self.max_epsilon, self.scheme = max_epsilon, scheme
        self._draws: list[tuple[int, int]] = []  # (n, K) per release
        self._epsilon: float | None = None

    def allows(self, server_round: int) -> bool:
        """Always: the rate of the next release is known only once its cohort is drawn, and the
        round loop then asks :meth:`allows_draw` before anything is released."""
        return True

    def allows_draw(self, draw: Draw) -> bool:
        """Whether releasing a round drawn as ``draw`` keeps epsilon within the cap."""
        if self.max_epsilon <= 0 or draw.wanted <= 0:
            return True
        return self._spent([*self._draws, (draw.eligible, draw.wanted)]) <= self.max_epsilon

    def record(self, server_round: int, num_sampled: int, population: int) -> None:
        """A release whose draw is unknown: accounted at rate 1 (no amplification)."""
        if num_sampled > 0:
            self.record_draw(server_round, Draw(self.scheme, 1, 1, ()))

    def record_draw(self, server_round: int, draw: Draw) -> None:
        """Compose the release of ``server_round`` at the rate its cohort was drawn with."""
        if draw.wanted > 0:
            self._draws.append((draw.eligible, draw.wanted))
            self._epsilon = None

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta`` against an observer of the released adapters."""
        if self._epsilon is None:
            self._epsilon = self._spent(self._draws)
        return self._epsilon

    def state(self) -> dict[str, float]:
        """Flat checkpoint state: each release's n and K."""
        out = {"releases": float(len(self._draws))}
        for i, (n, k) in enumerate(self._draws):
            out[f"n{i}"], out[f"k{i}"] = float(n), float(k)
        return out

    def load_state(self, state: dict[str, float]) -> None:
        """Restore the releases of a checkpoint."""
        count = int(state.get("releases", 0))
        self._draws = [(int(state[f"n{i}"]), int(state[f"k{i}"])) for i in range(count)]
        self._epsilon = None

    def _spent(self, draws: Sequence[tuple[int, int]]) -> float:
        return sampled_epsilon(self.scheme, draws, self.z, self.delta, self.method)


def sampled_epsilon(
    scheme: str, draws: Sequence[tuple[int, int]], z: float, delta: float, method: str
) -> float:
    """Epsilon at ``delta`` of one subsampled Gaussian release per (n, K) draw."""
    if not draws:
        return 0.0
    require("dp_accounting", "dp", "the epsilon of sampled rounds")
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    from fedge.privacy.accounting import PLD_INTERVAL

    relation = dp_accounting.NeighboringRelation
    if scheme == "fixed":
        accountant: dp_accounting.PrivacyAccountant = RdpAccountant(
            neighboring_relation=relation.REPLACE_ONE
        )
    elif method == "pld":
        accountant = PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    else:
        accountant = RdpAccountant()
    for (n, k), count in sorted(Counter(draws).items()):
        if scheme == "fixed" and k < n:
            event: dp_accounting.DpEvent = dp_accounting.SampledWithoutReplacementDpEvent(
                n, k, dp_accounting.GaussianDpEvent(z / 2)
            )
        elif scheme == "fixed":  # everyone in: a plain release, replace-one sensitivity 2C
            event = dp_accounting.GaussianDpEvent(z / 2)
        elif k < n:
            event = dp_accounting.PoissonSampledDpEvent(k / n, dp_accounting.GaussianDpEvent(z))
        else:
            event = dp_accounting.GaussianDpEvent(z)
        accountant.compose(event, count)
    eps = float(accountant.get_epsilon(delta))
    return eps if math.isfinite(eps) else math.inf


def sampled_budget(cfg: RunConfig) -> SampledDPBudget:
    """``privacy-budget = "fedge.server.sampling:sampled_budget"``: the DP aggregator's z and
    accountant, amplified by ``privacy-sampling`` (which must be set)."""
    from fedge.server.privacy.factories import dp_config

    scheme = sampling_scheme(cfg.extra, cfg.over_selection)
    if not scheme:
        raise ValueError(
            f"privacy-budget = fedge.server.sampling:sampled_budget needs {KEY_SAMPLING} = "
            "'poisson' or 'fixed': without it no draw is known to amplify"
        )
    return budget_for(dp_config(cfg, "central"), scheme)


def budget_for(dp: DPConfig, scheme: str) -> SampledDPBudget:
    """The amplified budget of a DP config under ``scheme``."""
    return SampledDPBudget(
        dp.noise_multiplier, dp.target_delta, dp.accountant, dp.max_epsilon, scheme
    )
