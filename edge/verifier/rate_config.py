"""Per-device rate limit settings: the one place their defaults live (CLIs and servers read them).

Free of heavy imports (no grpc), so the CLI's option defaults can come from here
while `--help` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_GENERATE_RATE = 1024.0  # Generate tokens/s per device with no option set
DEFAULT_PREFILL_RATE = 8192.0  # prefilled tokens/s per device with no option set


@dataclass(frozen=True)
class RateLimitConfig:
    """Per-device budgets; a rate of None leaves that kind unlimited.

    Generate and prefill are metered by default (a device cannot stream or prefill without
    bound with no option set); the defaults are loose ceilings, set them to the capacity
    shared. Verify is unmetered unless set (the engine shares its steps fairly by owner).
    """

    verify_rate: float | None = None  # verify tokens (draft + 1 per Verify) per second per device
    verify_burst: int = 256  # bucket size: the most verify tokens one device spends at once
    generate_rate: float | None = DEFAULT_GENERATE_RATE  # Generate tokens per second per device
    generate_burst: int = 512  # bucket size; also the largest max_new_tokens one call may ask
    # tokens opens, reopens and Generate prompts prefill, per second per device
    prefill_rate: float | None = DEFAULT_PREFILL_RATE
    prefill_burst: int = 4096  # bucket size; a longer prompt passes on a full bucket (into debt)
    max_devices: int = 100_000  # buckets kept; the least recently used is dropped beyond it

    def __post_init__(self) -> None:
        for name in ("verify_rate", "generate_rate", "prefill_rate"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"RateLimitConfig.{name} must be > 0 or None, got {value}")
        for name in ("verify_burst", "generate_burst", "prefill_burst", "max_devices"):
            if getattr(self, name) < 1:
                raise ValueError(f"RateLimitConfig.{name} must be >= 1, got {getattr(self, name)}")

    def check_covers_verify(self, max_draft: int, owner: str) -> None:
        """Refuse a verify bucket smaller than the longest verify: that call could never pass.

        `owner` names the config holding these limits (``ServerConfig``, ``FleetConfig``).
        """
        longest_verify = max_draft + 1
        if self.verify_rate is not None and self.verify_burst < longest_verify:
            raise ValueError(
                f"{owner}.rate_limits.verify_burst={self.verify_burst} is below "
                f"the cost of the longest verify (max_draft + 1 = {longest_verify}); raise it"
            )

    @property
    def enabled(self) -> bool:
        """Whether any kind is limited."""
        return any(r is not None for r in (self.verify_rate, self.generate_rate, self.prefill_rate))
