"""Built-in device tiers: median figures per tier, each sourced in docs/phones.md ("Tier figures").

A tier is the median device of a class. :func:`fedge.simulations.devicesim.population.from_tiers`
draws a population from tiers with a per-device log-normal spread around these medians.
Effective training throughput = peak FLOP/s x utilization: the peaks come from spec
sheets, the utilizations are assumptions (stated as such in the docs); override either
with your own population file.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Tier:
    """The median device of one class (SI units: FLOP/s, bytes, bit/s, seconds)."""

    name: str
    peak_flops: float  # spec-sheet peak FP32 FLOP/s of the accelerator training runs on
    utilization: float  # sustained fraction of the peak in LoRA training (assumption)
    memory_bytes: float  # memory an app may use for training
    uplink_bps: float
    downlink_bps: float
    latency_s: float  # round-trip time to the server
    mean_online_s: float  # mean eligible session (idle + charging + unmetered); 0 = always on
    mean_offline_s: float  # mean gap between eligible sessions
    peak_hour: float = 2.0  # diurnal availability: the hour of day its window centres on

    def __post_init__(self) -> None:
        """Refuse impossible figures, naming the tier and field."""
        positive = ("peak_flops", "utilization", "memory_bytes", "uplink_bps", "downlink_bps")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"tier {self.name!r}: {name} must be > 0")
        if self.latency_s < 0 or self.mean_online_s < 0 or self.mean_offline_s < 0:
            raise ValueError(f"tier {self.name!r}: latency and session lengths must be >= 0")
        if not 0 <= self.peak_hour < 24:
            raise ValueError(f"tier {self.name!r}: peak_hour must be in [0, 24)")
        if (self.mean_online_s == 0) != (self.mean_offline_s == 0):
            raise ValueError(
                f"tier {self.name!r}: set both mean_online_s and mean_offline_s, or neither"
            )

    @property
    def flops(self) -> float:
        """Effective training FLOP/s (peak x utilization)."""
        return self.peak_flops * self.utilization

    @property
    def always_on(self) -> bool:
        """Whether the tier is eligible all the time (no availability trace)."""
        return self.mean_online_s == 0


MBPS = 1e6
HOUR = 3600.0

# Home broadband (phones train only on unmetered Wi-Fi): Ookla Speedtest Global Index,
# global median fixed broadband, August 2024: 93.99 Mbps down, 48.36 Mbps up; fixed
# latency 10 ms (Ookla, November 2022). Slow links: Ookla global mobile, September 2020:
# 35.96 down, 11.22 up, 40 ms. Sessions and utilizations: assumptions (docs/phones.md).
HOME = {"uplink_bps": 48.36 * MBPS, "downlink_bps": 93.99 * MBPS, "latency_s": 0.010}
SLOW = {"uplink_bps": 11.22 * MBPS, "downlink_bps": 35.96 * MBPS, "latency_s": 0.040}
LAB = {"uplink_bps": 1000 * MBPS, "downlink_bps": 1000 * MBPS, "latency_s": 0.005}
# peak_hour: phones charge on Wi-Fi overnight (Bonawitz et al. 2019), laptops work by day
PHONE_SESSIONS = {"mean_online_s": 2 * HOUR, "mean_offline_s": 6 * HOUR, "peak_hour": 2.0}
WORKDAY = {"mean_online_s": 8 * HOUR, "mean_offline_s": 16 * HOUR, "peak_hour": 13.0}
ALWAYS = {"mean_online_s": 0.0, "mean_offline_s": 0.0}

TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        Tier("flagship", 4.608e12, 0.10, 12 * GB * 0.4, **HOME, **PHONE_SESSIONS),
        Tier("midrange", 1.2e12, 0.10, 8 * GB * 0.4, **HOME, **PHONE_SESSIONS),
        Tier("lowend", 0.72e12, 0.10, 4 * GB * 0.4, **SLOW, **PHONE_SESSIONS),
        Tier("laptop", 3.58e12, 0.20, 16 * GB * 0.5, **HOME, **WORKDAY),
        Tier("workstation", 82.6e12, 0.30, 24 * GB * 0.9, **LAB, **ALWAYS),
    )
}


def tier(name: str) -> Tier:
    """Return a built-in tier by name, or raise listing the known names."""
    if name not in TIERS:
        raise ValueError(f"unknown device tier {name!r}; built-in tiers: {', '.join(TIERS)}")
    return TIERS[name]


def parse_shares(spec: str) -> dict[str, float]:
    """Parse "flagship:0.2,midrange:0.5,..." into normalised shares, naming a bad entry."""
    shares: dict[str, float] = {}
    for item in (p.strip() for p in spec.split(",") if p.strip()):
        name, sep, value = item.partition(":")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not sep or share <= 0:
            raise ValueError(f"tiers entry {item!r} must look like 'flagship:0.2' (name:share > 0)")
        tier(name.strip())
        shares[name.strip()] = shares.get(name.strip(), 0.0) + share
    if not shares:
        raise ValueError("tiers is empty: name at least one tier, e.g. 'midrange:1'")
    total = sum(shares.values())
    return {k: v / total for k, v in shares.items()}
