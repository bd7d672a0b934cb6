"""The privacy-budget stop hook of the round loop: refuse a release that would overspend.

The round loop asks ``guard.allows(server_round)`` BEFORE sending a round's train
messages; when it answers False the loop checkpoints and stops cleanly with
:class:`PrivacyBudgetExhaustedError` caught and reported as ``stopped: budget``.
After a round's sum is released it calls ``guard.record(server_round, num_sampled,
population)``. ``state()``/``load_state()`` travel with the checkpoint so a resumed
run continues the accounting. The privacy part provides a real accountant behind
this protocol (loaded by dotted path from the ``privacy-budget`` config key);
:class:`NoBudget` is the default and never stops a run.
"""

from __future__ import annotations

from typing import Protocol


class PrivacyBudget(Protocol):
    """An accountant the round loop consults before and after each release."""

    def allows(self, server_round: int) -> bool:
        """Whether releasing ``server_round`` keeps epsilon within the budget."""
        ...

    def record(self, server_round: int, num_sampled: int, population: int) -> None:
        """Account for the release of ``server_round``."""
        ...

    def epsilon(self) -> float:
        """Epsilon spent so far (0.0 when nothing is accounted)."""
        ...

    def state(self) -> dict[str, float]:
        """Accountant state to checkpoint."""
        ...

    def load_state(self, state: dict[str, float]) -> None:
        """Restore accountant state from a checkpoint."""
        ...


class NoBudget:
    """No differential privacy: every round is allowed and nothing is spent."""

    def allows(self, server_round: int) -> bool:
        """Always allow."""
        return True

    def record(self, server_round: int, num_sampled: int, population: int) -> None:
        """Nothing to account."""

    def epsilon(self) -> float:
        """Nothing spent."""
        return 0.0

    def state(self) -> dict[str, float]:
        """No state."""
        return {}

    def load_state(self, state: dict[str, float]) -> None:
        """No state."""
