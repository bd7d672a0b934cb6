"""The device population as compact numpy arrays: built from tiers, or read from a table.

A population file (CSV, JSON or Parquet) holds one row per device, or, when it has a
``share`` column, one row per tier (custom or built-in) from which devices are drawn.
Columns (units in the name; a row naming a built-in ``tier`` may leave figures empty,
they default to the tier's medians):

==================  ==========================================================
``device_id``       optional integer label (default: the row index)
``tier``            a built-in tier name or any label (required with ``share``)
``share``           tier rows only: the tier's share of the population
``gflops``          effective training GFLOP/s ...
``speed``           ... or speed relative to this machine (calibrated step time) ...
``ms_per_sample``   ... or FedScale's ms per sample (training = 3x, as FedScale)
``memory_gb``       memory the app may use for training
``uplink_mbps``     ``downlink_mbps``: bandwidth; ``latency_ms``: round-trip time
``availability``    eligible intervals "start-end;start-end" in seconds (empty: always,
                    unless ``period_s`` > 0: then never)
``period_s``        the intervals repeat with this period (0 or empty: they do not)
==================  ==========================================================

Any error names the file, the row and the field, before the run starts.
"""

from __future__ import annotations

import csv
import json
import math
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge.simulations.devicesim.availability import draw_availability
from fedge.simulations.devicesim.tiers import GB, MBPS, TIERS, Tier

COMPUTE_KINDS = ("gflops", "speed", "ms_per_sample")
KIND_FLOPS, KIND_SPEED, KIND_MS_PER_SAMPLE = 0, 1, 2
FIGURES = ("memory_gb", "uplink_mbps", "downlink_mbps", "latency_ms")
KNOWN_COLUMNS = {"device_id", "tier", "share", "availability", "period_s", *COMPUTE_KINDS, *FIGURES}


class PopulationError(ValueError):
    """A malformed population or trace; the message names file, row and field."""


@dataclass(frozen=True)
class Population:
    """Per-device arrays (index = device); availability in CSR form (offsets into starts/ends)."""

    tier_names: tuple[str, ...]
    tier: np.ndarray  # int16 index into tier_names
    compute_kind: np.ndarray  # int8: KIND_FLOPS, KIND_SPEED or KIND_MS_PER_SAMPLE
    compute: np.ndarray  # FLOP/s, speed factor, or ms per sample
    memory_bytes: np.ndarray
    uplink_bps: np.ndarray
    downlink_bps: np.ndarray
    latency_s: np.ndarray
    offsets: np.ndarray  # int64, n + 1; device i owns intervals offsets[i]:offsets[i + 1]
    starts: np.ndarray  # float64 seconds, sorted per device
    ends: np.ndarray
    period_s: np.ndarray  # float64; 0 = the intervals do not repeat

    def __len__(self) -> int:
        return len(self.tier)

    def tier_of(self, device: int) -> str:
        """The tier label of one device."""
        return self.tier_names[int(self.tier[device])]

    def available_until(self, device: int, t: float) -> float | None:
        """End of the eligible interval containing time ``t`` (inf: always), or None if offline."""
        lo, hi = int(self.offsets[device]), int(self.offsets[device + 1])
        period = float(self.period_s[device])
        if lo == hi:  # no intervals: always eligible, unless a trace period says never
            return math.inf if period == 0 else None
        base = math.floor(t / period) * period if period > 0 else 0.0
        starts, ends = self.starts[lo:hi], self.ends[lo:hi]
        k = int(np.searchsorted(starts, t - base, side="right")) - 1
        if k < 0 or t - base >= ends[k]:
            return None
        until = base + float(ends[k])
        if period > 0 and ends[k] >= period and starts[0] <= 0:  # continues into the next cycle
            if ends[0] >= period:
                return math.inf
            until += float(ends[0])
        return until

    def available(self, t: float) -> np.ndarray:
        """Boolean mask of devices eligible at time ``t``."""
        return np.array([self.available_until(i, t) is not None for i in range(len(self))])

    def nbytes(self) -> int:
        """Bytes held by the arrays (what grows with the population)."""
        return sum(
            a.nbytes
            for a in (
                self.tier,
                self.compute_kind,
                self.compute,
                self.memory_bytes,
                self.uplink_bps,
                self.downlink_bps,
                self.latency_s,
                self.offsets,
                self.starts,
                self.ends,
                self.period_s,
            )
        )


# ---------------------------------------------------------------- from tiers
def from_tiers(
    shares: Mapping[str, float],
    size: int,
    seed: int,
    spread: float = 0.6,
    horizon_s: float = 7 * 24 * 3600.0,
    custom: Mapping[str, Tier] | None = None,
    pattern: str = "sessions",
) -> Population:
    """Draw ``size`` devices from tiers: figures log-normal around the tier medians (sigma ``spread``).

    Availability over ``horizon_s``, repeating after it (a trace of one week by default):
    ``sessions`` alternates exponential eligible / ineligible sessions with the tier's
    means; ``diurnal`` gives each device one window a day around its tier's peak hour
    (phones at night, laptops by day), as long on average as the tier's eligible share
    (:mod:`.availability`).
    """
    if size <= 0:
        raise PopulationError(f"population size must be > 0, got {size}")
    if spread < 0:
        raise PopulationError(f"spread must be >= 0, got {spread}")
    known = {**TIERS, **(custom or {})}
    names = tuple(shares)
    for name in names:
        if name not in known:
            raise PopulationError(f"unknown device tier {name!r}; known: {', '.join(known)}")
    rng = np.random.default_rng(seed)
    p = np.array([shares[n] for n in names], dtype=np.float64)
    idx = rng.choice(len(names), size=size, p=p / p.sum()).astype(np.int16)
    tiers = [known[n] for n in names]

    def draw(attr: str) -> np.ndarray:
        median = np.array([getattr(t, attr) for t in tiers])[idx]
        return median * np.exp(spread * rng.standard_normal(size))

    compute = draw("flops")
    up, down = draw("uplink_bps"), draw("downlink_bps")
    memory = np.array([t.memory_bytes for t in tiers])[idx]
    latency = np.array([t.latency_s for t in tiers])[idx]
    starts, ends, counts = draw_availability(pattern, tiers, idx, horizon_s, rng)
    offsets = np.zeros(size + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(counts)
    always = np.array([t.always_on for t in tiers])[idx]
    period = np.where(always, 0.0, horizon_s)
    return Population(
        names,
        idx,
        np.zeros(size, dtype=np.int8),
        compute,
        memory,
        up,
        down,
        latency,
        offsets,
        starts,
        ends,
        period,
    )


def _columns(
    labels: tuple[str, ...],
    tier: Sequence[int],
    kinds: Sequence[int],
    compute: Sequence[float],
    memory: Sequence[float],
    up: Sequence[float],
    down: Sequence[float],
    latency: Sequence[float],
    intervals: Sequence[Sequence[tuple[float, float]]],
    periods: Sequence[float],
) -> Population:
    """A Population from per-device lists (SI units), packed into typed arrays."""
    offsets, starts, ends = _pack(intervals)
    f64 = np.float64
    return Population(
        labels,
        np.asarray(tier, dtype=np.int16),
        np.asarray(kinds, dtype=np.int8),
        np.asarray(compute, dtype=f64),
        np.asarray(memory, dtype=f64),
        np.asarray(up, dtype=f64),
        np.asarray(down, dtype=f64),
        np.asarray(latency, dtype=f64),
        offsets,
        starts,
        ends,
        np.asarray(periods, dtype=f64),
    )


def _pack(intervals: Sequence[Sequence[tuple[float, float]]]) -> tuple[np.ndarray, ...]:
    """Per-device interval lists -> (offsets, starts, ends) arrays."""
    offsets = np.zeros(len(intervals) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(iv) for iv in intervals])
    flat = [pair for iv in intervals for pair in iv]
    starts = np.array([s for s, _ in flat], dtype=np.float64)
    ends = np.array([e for _, e in flat], dtype=np.float64)
    return offsets, starts, ends


# ---------------------------------------------------------------- from a file
def load_population(
    path: Path, size: int, seed: int, spread: float = 0.6, pattern: str = "sessions"
) -> Population:
    """Read a population file; rows with ``share`` are tiers from which ``size`` devices are drawn."""
    rows = read_rows(path)
    if not rows:
        raise PopulationError(f"{path}: no rows; add one row per device or per tier")
    columns = set().union(*(r.keys() for r in rows))
    unknown = sorted(columns - KNOWN_COLUMNS)
    if unknown:
        raise PopulationError(
            f"{path}: unknown column(s) {unknown}; known: {', '.join(sorted(KNOWN_COLUMNS))}"
        )
    if "share" in columns:
        custom: dict[str, Tier] = {}
        shares: dict[str, float] = {}
        for i, row in enumerate(rows, 1):
            t = _tier_row(f"{path} row {i}", row)
            custom[t.name] = t
            shares[t.name] = _number(f"{path} row {i}", row, "share", positive=True)
        return from_tiers(shares, size, seed, spread, custom=custom, pattern=pattern)
    return _device_rows(path, rows)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV, JSON (list, or {"devices": [...]}) or Parquet file; empty cells dropped."""
    if not path.is_file():
        raise PopulationError(f"population file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(newline="") as f:
            raw: list[dict[str, Any]] = list(csv.DictReader(f))
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise PopulationError(f"{path}: not valid JSON ({exc})") from exc
        raw = data.get("devices", []) if isinstance(data, dict) else data
        if not isinstance(raw, list) or not all(isinstance(r, dict) for r in raw):
            raise PopulationError(f"{path}: expected a list of objects or {{'devices': [...]}}")
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        raw = pq.read_table(path).to_pylist()
    else:
        raise PopulationError(f"{path}: unsupported format {suffix!r}; use .csv, .json or .parquet")
    return [{k: v for k, v in r.items() if v is not None and v != ""} for r in raw]


def _device_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> Population:
    """One device per row: figures from the row, or from the named built-in tier."""
    labels: list[str] = []
    tier_idx, kinds, compute, memory, up, down, latency, periods = ([] for _ in range(8))
    intervals: list[list[tuple[float, float]]] = []
    for i, row in enumerate(rows, 1):
        where = f"{path} row {i}"
        label = str(row.get("tier", "custom")).strip()
        base = TIERS.get(label)
        if base is None:
            _require_complete(where, row, label)
        if label not in labels:
            labels.append(label)
        tier_idx.append(labels.index(label))
        kind, value = _compute(where, row, base)
        kinds.append(kind)
        compute.append(value)
        memory.append(_figure(where, row, "memory_gb", base, GB, "memory_bytes"))
        up.append(_figure(where, row, "uplink_mbps", base, MBPS, "uplink_bps"))
        down.append(_figure(where, row, "downlink_mbps", base, MBPS, "downlink_bps"))
        latency.append(_figure(where, row, "latency_ms", base, 1e-3, "latency_s", zero_ok=True))
        period = _number(where, row, "period_s", default=0.0)
        if period < 0:
            raise PopulationError(f"{where}, field 'period_s': must be >= 0, got {period}")
        periods.append(period)
        intervals.append(parse_intervals(str(row.get("availability", "")), period, where))
    return _columns(
        tuple(labels), tier_idx, kinds, compute, memory, up, down, latency, intervals, periods
    )


def _require_complete(where: str, row: Mapping[str, Any], label: str) -> None:
    """A row whose tier is not built-in must give every figure itself."""
    missing = [f for f in FIGURES if f not in row]
    if not any(k in row for k in COMPUTE_KINDS):
        missing.insert(0, "gflops")
    if missing:
        raise PopulationError(
            f"{where}, field {missing[0]!r}: missing, and tier {label!r} is not a built-in tier "
            f"to take it from (built-in: {', '.join(TIERS)})"
        )


def _tier_row(where: str, row: Mapping[str, Any]) -> Tier:
    """A tier row: a built-in tier with overrides, or a custom tier giving every figure."""
    if "tier" not in row:
        raise PopulationError(f"{where}, field 'tier': missing (rows with 'share' are tiers)")
    name = str(row["tier"]).strip()
    base = TIERS.get(name)
    if base is None:
        _require_complete(where, row, name)
    kind, value = _compute(where, row, base)
    if kind != KIND_FLOPS:
        raise PopulationError(f"{where}: tier rows give throughput as 'gflops'")
    if "availability" in row:
        raise PopulationError(
            f"{where}, field 'availability': tier rows draw sessions; "
            "give per-device intervals in a one-row-per-device file"
        )
    return Tier(
        name,
        peak_flops=value,
        utilization=1.0,
        memory_bytes=_figure(where, row, "memory_gb", base, GB, "memory_bytes"),
        uplink_bps=_figure(where, row, "uplink_mbps", base, MBPS, "uplink_bps"),
        downlink_bps=_figure(where, row, "downlink_mbps", base, MBPS, "downlink_bps"),
        latency_s=_figure(where, row, "latency_ms", base, 1e-3, "latency_s", zero_ok=True),
        mean_online_s=base.mean_online_s if base else 0.0,
        mean_offline_s=base.mean_offline_s if base else 0.0,
    )


def _compute(where: str, row: Mapping[str, Any], base: Tier | None) -> tuple[int, float]:
    """(kind, value) of the row's throughput column, or the tier's FLOP/s."""
    given = [k for k in COMPUTE_KINDS if k in row]
    if len(given) > 1:
        raise PopulationError(f"{where}: give one of {', '.join(COMPUTE_KINDS)}, not {given}")
    if not given:
        if base is None:
            raise PopulationError(
                f"{where}, field 'gflops': missing (or 'speed' / 'ms_per_sample', or a built-in tier)"
            )
        return KIND_FLOPS, base.flops
    kind = COMPUTE_KINDS.index(given[0])
    value = _number(where, row, given[0], positive=True)
    return kind, value * 1e9 if kind == KIND_FLOPS else value


def _figure(
    where: str,
    row: Mapping[str, Any],
    field: str,
    base: Tier | None,
    scale: float,
    attr: str,
    zero_ok: bool = False,
) -> float:
    """One figure in SI units: the row's value x scale, else the tier's; refuse missing or negative."""
    if field not in row:
        if base is None:
            raise PopulationError(f"{where}, field {field!r}: missing (and no built-in tier)")
        return float(getattr(base, attr))
    value = _number(where, row, field)
    if value < 0 or (value == 0 and not zero_ok):
        raise PopulationError(
            f"{where}, field {field!r}: must be {'>= 0' if zero_ok else '> 0'}, got {value}"
        )
    return value * scale


def _number(
    where: str,
    row: Mapping[str, Any],
    field: str,
    positive: bool = False,
    default: float | None = None,
) -> float:
    if field not in row:
        if default is not None:
            return default
        raise PopulationError(f"{where}, field {field!r}: missing")
    try:
        value = float(row[field])
    except (TypeError, ValueError) as exc:
        raise PopulationError(f"{where}, field {field!r}: not a number: {row[field]!r}") from exc
    if not math.isfinite(value) or (positive and value <= 0):
        raise PopulationError(f"{where}, field {field!r}: must be a finite number > 0, got {value}")
    return value


def parse_intervals(spec: str, period: float, where: str) -> list[tuple[float, float]]:
    """Parse "0-3600;7200-9000" (seconds); refuse bad, unsorted or overlapping intervals."""
    out: list[tuple[float, float]] = []
    for item in (p.strip() for p in spec.split(";") if p.strip()):
        start, sep, end = item.partition("-")
        try:
            pair = (float(start), float(end))
        except ValueError:
            sep = ""
        if not sep:
            raise PopulationError(
                f"{where}, field 'availability': {item!r} is not 'start-end' in seconds"
            )
        out.append(pair)
    check_intervals(out, period, where)
    return out


def check_intervals(intervals: Sequence[tuple[float, float]], period: float, where: str) -> None:
    """Intervals must be non-empty, non-negative, sorted, non-overlapping and within the period."""
    previous_end = -math.inf
    for start, end in intervals:
        if not (math.isfinite(start) and math.isfinite(end)) or start < 0 or end <= start:
            raise PopulationError(f"{where}, field 'availability': bad interval {start:g}-{end:g}")
        if start < previous_end:
            raise PopulationError(
                f"{where}, field 'availability': interval {start:g}-{end:g} overlaps or precedes "
                f"the one ending at {previous_end:g}; sort the intervals and merge overlaps"
            )
        if period > 0 and end > period:
            raise PopulationError(
                f"{where}, field 'availability': interval {start:g}-{end:g} ends after period_s={period:g}"
            )
        previous_end = end


# ---------------------------------------------------------------- FedScale traces
class _PlainUnpickler(pickle.Unpickler):
    """Unpickle plain containers and numbers only: a trace file must not run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"the trace holds a {module}.{name} object; only plain dicts, lists and numbers are read"
        )


def read_pickle(path: Path) -> dict[Any, Any]:
    """Read a FedScale trace (a pickled dict) without executing anything in it."""
    if not path.is_file():
        raise PopulationError(f"trace file {path} does not exist")
    try:
        with path.open("rb") as f:
            data = _PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise PopulationError(f"{path}: not a readable FedScale trace ({exc})") from exc
    if not isinstance(data, dict) or not data:
        raise PopulationError(f"{path}: expected a non-empty dict keyed by client id")
    return data


def from_fedscale(
    capacity: Path, behaviour: Path | None, size: int, memory_gb: float = math.inf
) -> Population:
    """Devices from FedScale's ``client_device_capacity`` (+ ``client_behave_trace``) pickles.

    FedScale semantics are kept: ``computation`` is ms per sample (training costs 3x),
    ``communication`` is kbit/s both ways; client ``i`` uses the i-th key of each trace
    in sorted order, cycling as FedScale does. FedScale has no memory figure: ``memory_gb``.
    """
    cap = read_pickle(capacity)
    cap_keys = sorted(cap, key=str)
    trace = read_pickle(behaviour) if behaviour is not None else None
    trace_keys = sorted(trace, key=str) if trace is not None else []
    kinds, compute, bandwidth, periods = [], [], [], []
    intervals: list[list[tuple[float, float]]] = []
    for i in range(size):
        key = cap_keys[i % len(cap_keys)]
        entry = cap[key]
        where = f"{capacity} client {key!r}"
        if not isinstance(entry, dict):
            raise PopulationError(
                f"{where}: expected a dict with 'computation' and 'communication'"
            )
        kinds.append(KIND_MS_PER_SAMPLE)
        compute.append(_number(where, entry, "computation", positive=True))
        bandwidth.append(_number(where, entry, "communication", positive=True) * 1e3)
        if trace is None:
            periods.append(0.0)
            intervals.append([])
            continue
        tkey = trace_keys[i % len(trace_keys)]
        pairs, period = _fedscale_intervals(trace[tkey], f"{behaviour} client {tkey!r}")
        periods.append(period)
        intervals.append(pairs)
    zeros = [0] * size
    memory = [memory_gb * GB] * size
    return _columns(
        ("fedscale",),
        zeros,
        kinds,
        compute,
        memory,
        bandwidth,
        bandwidth,
        zeros,
        intervals,
        periods,
    )


def _fedscale_intervals(entry: Any, where: str) -> tuple[list[tuple[float, float]], float]:
    """FedScale behaviour entry {'active': [...], 'inactive': [...], 'finish_time': T} -> intervals."""
    if not isinstance(entry, dict) or not {"active", "inactive", "finish_time"} <= set(entry):
        raise PopulationError(f"{where}: expected 'active', 'inactive' and 'finish_time'")
    active, inactive = entry["active"], entry["inactive"]
    if (
        not isinstance(active, list)
        or not isinstance(inactive, list)
        or len(active) != len(inactive)
    ):
        raise PopulationError(f"{where}, field 'active': must pair one-to-one with 'inactive'")
    period = float(entry["finish_time"])
    pairs = [(float(a), float(b)) for a, b in zip(active, inactive, strict=True)]
    check_intervals(pairs, period, where)
    return pairs, period


def tier_counts(pop: Population) -> dict[str, int]:
    """How many devices each tier label has."""
    counts = np.bincount(pop.tier, minlength=len(pop.tier_names))
    return {name: int(c) for name, c in zip(pop.tier_names, counts, strict=True)}


def as_rows(pop: Population) -> Iterable[dict[str, Any]]:
    """The population as one dict per device, in file units (for reports and round trips)."""
    for i in range(len(pop)):
        lo, hi = int(pop.offsets[i]), int(pop.offsets[i + 1])
        kind = COMPUTE_KINDS[int(pop.compute_kind[i])]
        value = pop.compute[i] / 1e9 if kind == "gflops" else pop.compute[i]
        yield {
            "device_id": i,
            "tier": pop.tier_of(i),
            kind: float(value),
            "memory_gb": float(pop.memory_bytes[i] / GB),
            "uplink_mbps": float(pop.uplink_bps[i] / MBPS),
            "downlink_mbps": float(pop.downlink_bps[i] / MBPS),
            "latency_ms": float(pop.latency_s[i] * 1e3),
            "availability": ";".join(
                f"{s:g}-{e:g}" for s, e in zip(pop.starts[lo:hi], pop.ends[lo:hi], strict=True)
            ),
            "period_s": float(pop.period_s[i]),
        }
