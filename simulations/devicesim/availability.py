"""When devices are eligible to train: drawn availability traces for the built-in tiers.

Two patterns, both over a horizon that then repeats (one week by default):

* ``sessions``: alternating exponential eligible / ineligible sessions with the tier's
  means, at any hour;
* ``diurnal``: one eligible window a day per device, centred on its tier's peak hour
  (phones at 02:00, idle and charging on Wi-Fi overnight, as Bonawitz et al. 2019 saw
  participation peak at night; laptops at 13:00, a workday), jittered by an hour
  (normal) day to day, lasting the tier's eligible share of a day (2 h on / 6 h off: 6 h)
  times a log-normal factor (sigma 0.3). Every device shares one time zone, so the
  federation sees a population that swells at night and thins by day.

Always-on tiers get no intervals. Everything is drawn per tier as matrices (devices x
sessions or days), so no Python loop runs per random draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedge.simulations.devicesim.tiers import Tier

PATTERNS = ("sessions", "diurnal")
DAY = 24 * 3600.0
DIURNAL_JITTER_S = 3600.0  # sd of a window's centre, day to day
DIURNAL_LENGTH_SIGMA = 0.3  # log-normal sigma of a window's length around the tier's share
Intervals = tuple[np.ndarray, np.ndarray, np.ndarray]  # flat starts, flat ends, count per device


def draw_availability(
    pattern: str, tiers: Sequence[Tier], idx: np.ndarray, horizon_s: float, rng: np.random.Generator
) -> Intervals:
    """Eligible intervals of every device (``idx`` = its tier) under ``pattern``."""
    if pattern == "sessions":
        return sessions(tiers, idx, horizon_s, rng)
    if pattern == "diurnal":
        return diurnal(tiers, idx, horizon_s, rng)
    raise ValueError(f"availability must be one of {PATTERNS}, got {pattern!r}")


def sessions(
    tiers: Sequence[Tier], idx: np.ndarray, horizon_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Alternating exponential eligible / ineligible sessions over [0, horizon) per device.

    Returns flat (starts, ends) in device order and the count per device; always-on tiers
    get no intervals. Drawn per tier as one (devices x sessions) matrix, so no Python loop
    runs per device.
    """
    per_device: list[tuple[np.ndarray, np.ndarray]] = [(np.empty(0), np.empty(0))] * len(idx)
    for k, t in enumerate(tiers):
        members = np.flatnonzero(idx == k)
        if t.always_on or not len(members):
            continue
        cycles = int(np.ceil(horizon_s / (t.mean_online_s + t.mean_offline_s) * 3)) + 4
        on = rng.exponential(t.mean_online_s, (len(members), cycles))
        off = rng.exponential(t.mean_offline_s, (len(members), cycles))
        first_on = rng.random(len(members)) < t.mean_online_s / (t.mean_online_s + t.mean_offline_s)
        lead = np.where(first_on, 0.0, off[:, 0])  # devices starting offline wait one gap first
        begin = lead[:, None] + np.concatenate(
            [np.zeros((len(members), 1)), np.cumsum(on[:, :-1] + off[:, 1:], axis=1)], axis=1
        )
        end = np.minimum(begin + on, horizon_s)
        keep = begin < horizon_s
        for row, m in enumerate(members):
            sel = keep[row]
            per_device[m] = (begin[row, sel], end[row, sel])
    return _flatten(per_device)


def diurnal(
    tiers: Sequence[Tier], idx: np.ndarray, horizon_s: float, rng: np.random.Generator
) -> Intervals:
    """One window a day per device around its tier's peak hour, clipped to [0, horizon)."""
    per_device: list[tuple[np.ndarray, np.ndarray]] = [(np.empty(0), np.empty(0))] * len(idx)
    days = int(np.ceil(horizon_s / DAY)) + 1
    for k, t in enumerate(tiers):
        members = np.flatnonzero(idx == k)
        if t.always_on or not len(members):
            continue
        share = t.mean_online_s / (t.mean_online_s + t.mean_offline_s)
        shape = (len(members), days)
        length = share * DAY * np.exp(DIURNAL_LENGTH_SIGMA * rng.standard_normal(shape))
        length = np.minimum(length, 0.9 * DAY)  # windows of consecutive days never touch
        centre = np.arange(days) * DAY + t.peak_hour * 3600.0
        centre = centre + DIURNAL_JITTER_S * rng.standard_normal(shape)
        begin = np.clip(centre - length / 2, 0.0, horizon_s)
        end = np.clip(centre + length / 2, 0.0, horizon_s)
        for row, m in enumerate(members):
            b, e = begin[row], end[row]
            keep = e > b
            b, e = b[keep], e[keep]
            e[:-1] = np.minimum(e[:-1], b[1:])  # jitter never lets one window overrun the next
            per_device[m] = (b, e)
    return _flatten(per_device)


def _flatten(per_device: Sequence[tuple[np.ndarray, np.ndarray]]) -> Intervals:
    """Per-device (starts, ends) -> flat arrays in device order and the count per device."""
    counts = np.array([len(s) for s, _ in per_device], dtype=np.int64)
    starts = np.concatenate([s for s, _ in per_device]) if counts.sum() else np.empty(0)
    ends = np.concatenate([e for _, e in per_device]) if counts.sum() else np.empty(0)
    return starts.astype(np.float64), ends.astype(np.float64), counts
