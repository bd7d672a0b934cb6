"""Cumulative (epsilon, delta) of the server's Gaussian releases, with Flower's RDP accountant."""

from __future__ import annotations

from collections import Counter

from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from server.privacy.config import DPConfig

_SAMPLING = {
    "none": (SamplingMethod.NO_AMPLIFICATION, NeighboringRelation.ADD_OR_REMOVE_ONE),
    "poisson": (SamplingMethod.POISSON, NeighboringRelation.ADD_OR_REMOVE_ONE),
    "without-replacement": (SamplingMethod.WITHOUT_REPLACEMENT, NeighboringRelation.REPLACE_ONE),
}


class RdpBudget:
    """The round loop's privacy budget (``server.budget.PrivacyBudget``) over dp-accounting's RDP.

    One release per round: a Gaussian mechanism with noise multiplier z on a sum whose
    per-client sensitivity is C. Amplification by sampling is only claimed when
    ``cfg.sampling`` says the loop samples that way. ``allows`` checks the next release
    before it happens, so the run stops before overspending, never after.
    """

    def __init__(self, cfg: DPConfig) -> None:
        self.cfg = cfg
        self._releases: list[tuple[int, int]] = []  # (sampled, population) per round
        self._accountant: RdpAccountant | None = None

    def allows(self, server_round: int) -> bool:
        """Whether one more release keeps epsilon within ``max_epsilon`` (always, when 0).

        The next round is assumed to sample like the last one; before the first round,
        like a full-population release, which over-estimates and so never overspends.
        """
        if self.cfg.max_epsilon <= 0:
            return True
        projected = self._build([*self._releases, self._releases[-1] if self._releases else (1, 1)])
        return projected.get_epsilon(self.cfg.target_delta) <= self.cfg.max_epsilon

    def record(self, server_round: int, num_sampled: int, population: int) -> None:
        """Compose the release of ``server_round`` (``num_sampled`` of ``population`` clients)."""
        if num_sampled <= 0:
            return
        self._releases.append((num_sampled, max(population, num_sampled)))
        self._accountant = None  # rebuilt on demand

    def epsilon(self) -> float:
        """Epsilon spent so far at ``cfg.target_delta`` (0.0 before the first release)."""
        if not self._releases:
            return 0.0
        if self._accountant is None:
            self._accountant = self._build(self._releases)
        return float(self._accountant.get_epsilon(self.cfg.target_delta))

    def state(self) -> dict[str, float]:
        """Flat checkpoint state: the (sampled, population) of every release."""
        out: dict[str, float] = {"releases": float(len(self._releases))}
        for i, (s, p) in enumerate(self._releases):
            out[f"sampled-{i}"] = float(s)
            out[f"population-{i}"] = float(p)
        return out

    def load_state(self, state: dict[str, float]) -> None:
        """Replay the releases of a checkpoint so a resumed run continues the accounting."""
        self._releases = [
            (int(state[f"sampled-{i}"]), int(state[f"population-{i}"]))
            for i in range(int(state.get("releases", 0)))
        ]
        self._accountant = None

    def _build(self, releases: list[tuple[int, int]]) -> RdpAccountant:
        """An accountant over ``releases`` at the latest population, equal events composed once."""
        population = releases[-1][1]
        accountant = self._new(population)
        for sampled, count in sorted(Counter(s for s, _ in releases).items()):
            accountant.compose(self._event(sampled, population), count=count)
        return accountant

    def _new(self, population: int) -> RdpAccountant:
        method, relation = _SAMPLING[self.cfg.sampling]
        return RdpAccountant(
            PrivacyConfig(
                target_delta=self.cfg.target_delta,
                population_size=population,
                neighboring_relation=relation,
                sampling_method=method,
            )
        )

    def _event(self, sampled: int, population: int) -> GaussianPrivacyEvent:
        return GaussianPrivacyEvent(
            noise_multiplier=self.cfg.noise_multiplier,
            sample_size=min(sampled, population),
            population_size=population,
        )
