"""Cumulative (epsilon, delta) of the server's Gaussian releases: dp-accounting's RDP or PLD."""

from __future__ import annotations

from fedge.privacy.accounting import gaussian_epsilon
from fedge.server.privacy.config import DPConfig


class DPBudget:
    """The round loop's privacy budget (``fedge.server.budget.PrivacyBudget``) over dp-accounting.

    One release per round: a Gaussian mechanism with noise multiplier z on a sum whose
    per-client sensitivity (add or remove one client) is C. No amplification by sampling is
    claimed (the loop's sampling is not secret). ``cfg.accountant`` picks RDP or the tighter
    PLD; ``method`` says which one the reported epsilon comes from. ``allows`` checks the
    next release before it happens, so the run stops before overspending, never after.
    """

    def __init__(self, cfg: DPConfig) -> None:
        self.cfg = cfg
        self.method = cfg.accountant
        self._releases = 0
        self._epsilon: float | None = None

    def allows(self, server_round: int) -> bool:
        """Whether one more release keeps epsilon within ``max_epsilon`` (always, when 0)."""
        if self.cfg.max_epsilon <= 0:
            return True
        return self._spent(self._releases + 1) <= self.cfg.max_epsilon

    def record(self, server_round: int, num_sampled: int, population: int) -> None:
        """Compose the release of ``server_round`` (nothing when no client was sampled)."""
        if num_sampled > 0:
            self._releases += 1
            self._epsilon = None

    def epsilon(self) -> float:
        """Epsilon spent so far at ``cfg.target_delta`` (0.0 before the first release)."""
        if self._epsilon is None:
            self._epsilon = self._spent(self._releases)
        return self._epsilon

    def state(self) -> dict[str, float]:
        """Flat checkpoint state: the number of releases."""
        return {"releases": float(self._releases)}

    def load_state(self, state: dict[str, float]) -> None:
        """Restore the releases of a checkpoint so a resumed run continues the accounting."""
        self._releases = int(state.get("releases", 0))
        self._epsilon = None

    def _spent(self, releases: int) -> float:
        return gaussian_epsilon(
            [self.cfg.noise_multiplier] * releases, self.cfg.target_delta, self.method
        )
