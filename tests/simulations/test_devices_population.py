"""Device populations: built-in tiers, files in three formats, FedScale traces, and refusals.

Every malformed input must be refused before a run starts, naming file, row and field.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from fedge.simulations.devicesim.population import (
    KIND_MS_PER_SAMPLE,
    PopulationError,
    as_rows,
    from_fedscale,
    from_tiers,
    load_population,
)
from fedge.simulations.devicesim.tiers import TIERS, parse_shares

HEADER = (
    "device_id,tier,gflops,memory_gb,uplink_mbps,downlink_mbps,latency_ms,availability,period_s\n"
)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_tiers_draw_medians_shares_and_sessions() -> None:
    """A large draw: shares match, per-tier median compute matches the tier, phones churn."""
    pop = from_tiers(parse_shares("flagship:1,workstation:1"), 4000, seed=0, spread=0.6)
    counts = np.bincount(pop.tier)
    assert abs(counts[0] - 2000) < 150
    flagship = pop.compute[pop.tier == 0]
    assert np.median(flagship) == pytest.approx(TIERS["flagship"].flops, rel=0.1)
    phone = int(np.flatnonzero(pop.tier == 0)[0])
    workstation = int(np.flatnonzero(pop.tier == 1)[0])
    assert pop.offsets[phone + 1] > pop.offsets[phone]  # phones have sessions ...
    assert (
        pop.offsets[workstation + 1] == pop.offsets[workstation]
    )  # ... workstations are always on
    share_online = pop.available(3600.0 * 30)[pop.tier == 0].mean()
    assert 0.1 < share_online < 0.45  # 2 h on / 6 h off: about a quarter eligible


def test_population_memory_is_flat_in_size() -> None:
    """Arrays only: 10,000 devices cost the same per device as 1,000 (no per-device objects)."""
    small = from_tiers(parse_shares("midrange:1"), 1000, seed=1)
    big = from_tiers(parse_shares("midrange:1"), 10_000, seed=1)
    assert big.nbytes() / 10_000 == pytest.approx(small.nbytes() / 1000, rel=0.25)
    assert big.nbytes() < 10_000 * 1024  # a week of sessions in well under 1 KiB per device


@pytest.mark.parametrize("suffix", ["csv", "json", "parquet"])
def test_device_rows_round_trip_in_every_format(tmp_path: Path, suffix: str) -> None:
    rows = [
        {"tier": "flagship", "availability": "0-3600;7200-9000", "period_s": 86400},
        {
            "tier": "lab",
            "gflops": 50.0,
            "memory_gb": 2.0,
            "uplink_mbps": 5.0,
            "downlink_mbps": 20.0,
            "latency_ms": 30.0,
        },
    ]
    path = tmp_path / f"pop.{suffix}"
    if suffix == "csv":
        keys = sorted({k for r in rows for k in r})
        path.write_text(
            ",".join(keys)
            + "\n"
            + "\n".join(",".join(str(r.get(k, "")) for k in keys) for r in rows)
            + "\n"
        )
    elif suffix == "json":
        path.write_text(json.dumps({"devices": rows}))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = sorted({k for r in rows for k in r})
        pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in keys}), path)
    pop = load_population(path, size=2, seed=0)
    assert len(pop) == 2 and pop.tier_names == ("flagship", "lab")
    assert pop.compute[0] == pytest.approx(TIERS["flagship"].flops)  # filled from the tier
    assert pop.compute[1] == pytest.approx(50e9)
    assert pop.uplink_bps[1] == pytest.approx(5e6) and pop.latency_s[1] == pytest.approx(0.03)
    assert pop.available_until(0, 86400 + 100) == pytest.approx(86400 + 3600)
    assert pop.available_until(0, 5000) is None
    assert list(as_rows(pop))[1]["gflops"] == pytest.approx(50.0)


def test_tier_rows_with_shares_draw_a_population(tmp_path: Path) -> None:
    path = write(tmp_path / "tiers.csv", "tier,share,gflops\nflagship,1,\nlowend,3,10\n")
    pop = load_population(path, size=400, seed=0)
    assert len(pop) == 400 and set(pop.tier_names) == {"flagship", "lowend"}
    assert np.median(pop.compute[pop.tier == 1]) == pytest.approx(10e9, rel=0.2)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("0,custom,10,,5,20,30,,\n", r"row 1, field 'memory_gb': missing, and tier 'custom'"),
        ("0,flagship,,,-5,,,,\n", r"row 1, field 'uplink_mbps': must be > 0, got -5"),
        (
            "0,flagship,,,,,,3600-7200;0-100,\n",
            r"row 1, field 'availability': interval 0-100 overlaps or precedes",
        ),
        (
            "0,flagship,,,,,,0-100;50-200,\n",
            r"row 1, field 'availability': interval 50-200 overlaps",
        ),
        (
            "0,flagship,,,,,,0-100,\n1,flagship,,,,,,200-100,\n",
            r"row 2, field 'availability': bad interval 200-100",
        ),
        ("0,flagship,,,,,,0-7200,3600\n", r"ends after period_s=3600"),
        (
            "0,superphone,,,,,,,\n",
            r"row 1, field 'gflops': missing, and tier 'superphone' is not a built-in",
        ),
        ("0,flagship,abc,,,,,,\n", r"row 1, field 'gflops': not a number"),
    ],
)
def test_malformed_population_files_are_refused_naming_file_row_and_field(
    tmp_path: Path, body: str, expected: str
) -> None:
    path = write(tmp_path / "bad.csv", HEADER + body)
    with pytest.raises(PopulationError, match=expected) as info:
        load_population(path, size=2, seed=0)
    assert str(path) in str(info.value)


def test_unknown_columns_and_formats_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PopulationError, match=r"unknown column\(s\) \['bandwith_mbps'\]"):
        load_population(write(tmp_path / "p.csv", "tier,bandwith_mbps\nflagship,3\n"), 1, 0)
    with pytest.raises(PopulationError, match=r"unsupported format '\.xlsx'"):
        load_population(write(tmp_path / "p.xlsx", ""), 1, 0)
    with pytest.raises(ValueError, match="unknown device tier 'tablet'"):
        parse_shares("tablet:1")


def test_fedscale_traces_are_read_with_fedscale_semantics(tmp_path: Path) -> None:
    """computation = ms per sample (training 3x), communication = kbit/s, active/inactive pairs."""
    cap = tmp_path / "client_device_capacity"
    cap.write_bytes(
        pickle.dumps(
            {
                1: {"computation": 20.0, "communication": 800.0},
                2: {"computation": 5.0, "communication": 4000.0},
            }
        )
    )
    trace = tmp_path / "client_behave_trace"
    trace.write_bytes(
        pickle.dumps(
            {
                7: {
                    "duration": 100,
                    "active": [0, 50],
                    "inactive": [10, 80],
                    "finish_time": 100,
                    "model": "x",
                }
            }
        )
    )
    pop = from_fedscale(cap, trace, size=3)
    assert list(pop.compute_kind) == [KIND_MS_PER_SAMPLE] * 3
    assert list(pop.compute) == [20.0, 5.0, 20.0]  # client i uses the i-th key, cycling
    assert pop.uplink_bps[1] == pytest.approx(4e6)
    assert pop.available_until(2, 155.0) == pytest.approx(180.0)
    assert pop.available_until(2, 120.0) is None


def test_a_fedscale_pickle_carrying_code_is_refused(tmp_path: Path) -> None:
    # {1: builtins.print("pwned")}, written as opcodes: pickling `print` itself names whatever
    # `builtins.print` is at the time (Ray replaces it in a process that started Ray)
    evil = b"(dp0\nI1\ncbuiltins\nprint\n(Vpwned\ntRs."
    bad = tmp_path / "cap"
    bad.write_bytes(evil)
    with pytest.raises(PopulationError, match=r"builtins\.print"):
        from_fedscale(bad, None, size=1)
    broken = tmp_path / "trace"
    broken.write_bytes(
        pickle.dumps({1: {"active": [0, 50], "inactive": [60, 80], "finish_time": 100}})
    )
    good = tmp_path / "good"
    good.write_bytes(pickle.dumps({1: {"computation": 1.0, "communication": 1.0}}))
    with pytest.raises(PopulationError, match="overlaps or precedes"):
        from_fedscale(good, broken, size=1)


def test_diurnal_availability_puts_phones_online_at_night_and_laptops_by_day() -> None:
    """``availability = "diurnal"``: phones (2 h on / 6 h off: a quarter of the day) are
    eligible in one window a day around 02:00, laptops (8 / 16 h) around 13:00. At 02:00
    most phones and almost no laptops are eligible, at 14:00 the other way round, and over a
    day each tier keeps its share (on main the option did not exist: [devices] refused it)."""
    from fedge.simulations.devicesim.config import DeviceConfig
    from fedge.simulations.devicesim.setup import build_population

    dcfg = DeviceConfig(tiers="midrange:1,laptop:1", availability="diurnal")
    pop = build_population(dcfg, nodes=400, seed=0)
    phone = np.array([pop.tier_of(i) == "midrange" for i in range(len(pop))])

    def share(hour: float, mask: np.ndarray, day: int = 2) -> float:
        return float(pop.available((day * 24 + hour) * 3600.0)[mask].mean())

    assert share(2, phone) > 0.6 and share(2, ~phone) < 0.05
    assert share(14, ~phone) > 0.6 and share(14, phone) < 0.05
    daily = [share(h + 1.0, phone) for h in range(0, 24, 2)]
    assert abs(np.mean(daily) - 0.25) < 0.04
    assert share(2, phone, day=9) == pytest.approx(share(2, phone, day=2))  # repeats weekly
    with pytest.raises(ValueError, match="availability must be one of"):
        DeviceConfig(availability="weekends")
