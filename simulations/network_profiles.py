"""Named network profiles: round-trip time, jitter and bandwidth presets, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NetworkProfile:
    """A named link: round-trip time, jitter and bandwidth per direction (None = unlimited)."""

    name: str
    rtt_ms: float
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None

    def __post_init__(self) -> None:
        for field in ("rtt_ms", "jitter_ms"):
            if getattr(self, field) < 0:
                raise ValueError(f"NetworkProfile.{field} must be >= 0, got {getattr(self, field)}")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise ValueError(
                f"NetworkProfile.bandwidth_mbit must be > 0 or None, got {self.bandwidth_mbit}"
            )


# Typical figures for a phone's path to a cloud region (median RTT, downlink-ish bandwidth).
PROFILES: dict[str, NetworkProfile] = {
    p.name: p
    for p in (
        NetworkProfile("loopback", 0.0),
        NetworkProfile("lan", 1.0, 0.1, 1000.0),
        NetworkProfile("wifi", 10.0, 2.0, 100.0),
        NetworkProfile("metro-20", 20.0, 2.0, 100.0),
        NetworkProfile("4g", 50.0, 10.0, 20.0),
        NetworkProfile("wan-100", 100.0, 5.0, 50.0),
        NetworkProfile("intercontinental-200", 200.0, 10.0, 20.0),
    )
}


def profile(name: str) -> NetworkProfile:
    """The profile called `name`; the error lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown network profile {name!r}; known: {sorted(PROFILES)}") from None
