"""FedScale's own trace files, end to end: a federation on the virtual clock they describe.

Both files are written as FedScale ships them (``benchmark/dataset/data/device_info``):
pickled dicts keyed by integer client id; ``client_device_capacity`` values
``{"computation": ms per sample, "communication": kbit/s}``, ``client_behave_trace`` values
``{"duration", "inactive", "finish_time", "active", "model"}`` with integer seconds. Four
devices, FedAvg, one local step of batch 2; the figures time this very model
(``fedscale-reference-gflops = 0``), so a step takes 3 x 2 x 1000 ms = 6 s; links are
fast enough to ignore:

======  ==========================  ===========================================
device  trace (period 518,400 s)    rounds 1 (opens at 0) and 2 (at 6)
======  ==========================  ===========================================
0, 1    active 0-518400: always     kept both rounds
2       active 100000-200000        offline at both starts: never selected
3       active 0-3                  starts round 1, vanishes at 3 s: dropped
======  ==========================  ===========================================
"""

from __future__ import annotations

import csv
import pickle
from pathlib import Path

from tests.simulations.federations import CONFIG, client_app

PERIOD = 518_400


def _trace(active: list[int], inactive: list[int]) -> dict[str, object]:
    return {
        "duration": sum(b - a for a, b in zip(active, inactive, strict=True)),
        "inactive": inactive,
        "finish_time": PERIOD,
        "active": active,
        "model": "SM-G960F",
    }


def test_a_federation_runs_on_fedscale_capacity_and_behaviour_files(
    micro_zoo,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Device 2 (offline at every round's start) is never selected, device 3 drops out
    offline mid-round in round 1 and is not eligible in round 2, devices 0 and 1 train twice;
    round 1 closes at device 0's and 1's report, 6 s."""
    from fedge.simulations.runner import _scenario_from_tables, run_simulation

    capacity = tmp_path / "client_device_capacity"
    behaviour = tmp_path / "client_behave_trace"
    fast = {"computation": 1000.0, "communication": 1e9}  # 1 s per sample; kbit/s
    capacity.write_bytes(pickle.dumps({i: dict(fast) for i in range(1, 5)}))
    traces = {
        1: _trace([0], [PERIOD]),
        2: _trace([0], [PERIOD]),
        3: _trace([100_000], [200_000]),
        4: _trace([0], [3]),
    }
    behaviour.write_bytes(pickle.dumps(traces))
    scenario = _scenario_from_tables(
        "fedscale",
        {"num-supernodes": 4, "engine": "inprocess"},
        {**CONFIG, "strategy": "fedavg", "num-server-rounds": 2, "min-train-nodes": 1},
        None,
        None,
        {
            "fedscale-capacity": str(capacity),
            "fedscale-behaviour": str(behaviour),
            "fedscale-reference-gflops": 0.0,
        },
    )
    outcome = run_simulation(scenario, tmp_path / "run", client_app=client_app())
    assert outcome is not None and outcome.status == "completed"
    with (tmp_path / "run" / "devices" / "per_device.csv").open() as f:
        rows = {int(r["device_id"]): r for r in csv.DictReader(f)}
    trained = {d: int(float(r["trained"])) for d, r in rows.items()}
    selected = {d: int(float(r["selected"])) for d, r in rows.items()}
    assert trained == {0: 2, 1: 2, 2: 0, 3: 0}
    assert selected[2] == 0 and selected[3] == 1
    assert int(float(rows[3]["dropped_offline"])) == 1
