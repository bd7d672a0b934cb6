"""A real federation on simulated devices (`fedge simulate` with a [devices] table), end to end.

Seven devices, each built to exercise one rule (FedProx, K = 4 reports, 50% over-selection,
deadline 3 s, 4 local steps of batch 4; step = 3 x batch x ms / 1000 s, links instantaneous;
the micro model needs 2.05 MB at batch 4, 1.21 MB at 2, 0.78 MB at 1):

====== ============ ============= ==========================================================
device ms/sample    step seconds  round 1 (opens at 0)
====== ============ ============= ==========================================================
0      10           0.12          reports at 0.48: kept
1      20           0.24          reports at 0.96: kept
2      55           0.66          would report at 2.64, after the 4th report (2.4): late
3      100          1.2           4.8 > deadline 3: FedProx runs floor(3 / 1.2) = 2 steps,
                                  reports at 2.4: kept, partial
4      50 (0-1.5 s) 0.6           eligible only until 1.5 s: offline mid-round
5      10, 1 KB     0.12          cannot fit the model: excluded, never selected
6      15, 1.5 MB   0.09          fits at batch 2 only (shrink): reports at 0.36, kept
====== ============ ============= ==========================================================

Round 2 opens at 2.4 without device 4 and repeats the pattern; it closes at 4.8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.simulations.federations import simulate_here

DEVICES = """device_id,tier,ms_per_sample,memory_gb,uplink_mbps,downlink_mbps,latency_ms,availability
0,fast,10,4,1e6,1e6,0,
1,fast,20,4,1e6,1e6,0,
2,slow,55,4,1e6,1e6,0,
3,slower,100,4,1e6,1e6,0,
4,leaving,50,4,1e6,1e6,0,0-1.5
5,tiny,10,0.000001,1e6,1e6,0,
6,small,15,0.0015,1e6,1e6,0,
"""

SCENARIO = """
[scenario]
num-supernodes = 7
engine = "inprocess"

[config]
model = "zoo:micro"
num-server-rounds = 2
strategy = "fedprox"
fraction-train = 0.5
target-reports = 4
over-selection = 0.5
min-train-nodes = 1
min-available-nodes = 2
max-chars-per-client = 20000
local-steps = 4
batch-size = 4
seq-len = 32
lora-r = 2
lora-alpha = 4
server-eval-batches = 2
client-eval = false
save-merged = false

[devices]
population = "{population}"
deadline-s = 3
memory-policy = "shrink"
fedscale-reference-gflops = 0  # the ms_per_sample figures above time this very model
"""


@pytest.fixture(scope="module")
def run(micro_zoo, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    """One two-round FedProx federation on the seven devices (the in-process engine)."""
    root = tmp_path_factory.mktemp("devices")
    (root / "devices.csv").write_text(DEVICES)
    (root / "scenario.toml").write_text(SCENARIO.format(population=root / "devices.csv"))
    out = root / "run"
    simulate_here([str(root / "scenario.toml"), "--out", str(out)])
    return out


def per_device(run: Path) -> dict[int, dict[str, str]]:
    import csv

    with (run / "devices" / "per_device.csv").open() as f:
        return {int(r["device_id"]): r for r in csv.DictReader(f)}


def test_first_k_reports_are_kept_on_the_virtual_clock(run: Path) -> None:
    rounds = [
        json.loads(line) for line in (run / "devices" / "rounds.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rounds] == [1, 2]
    assert [r["target"] for r in rounds] == [4, 4]
    assert [r["selected"] for r in rounds] == [6, 5]  # ceil(4 x 1.5) capped by eligible devices
    assert [r["trained"] for r in rounds] == [4, 4]
    assert [r["dropped_late"] for r in rounds] == [1, 1]
    assert rounds[0]["end_s"] == pytest.approx(2.4, abs=1e-6)  # closed at the 4th report
    assert rounds[1]["end_s"] == pytest.approx(4.8, abs=1e-6)
    d = per_device(run)
    assert float(d[2]["dropped_late"]) == 2 and float(d[2]["steps"]) == 0  # never trained here
    assert float(d[0]["trained"]) == 2 and float(d[0]["steps"]) == 8


def test_a_device_leaving_mid_round_drops_out_and_is_not_sampled_again(run: Path) -> None:
    d = per_device(run)
    assert float(d[4]["dropped_offline"]) == 1 and float(d[4]["selected"]) == 1
    assert float(d[4]["wasted_s"]) == pytest.approx(1.5, abs=1e-6)  # computed 0 .. 1.5 s, lost


def test_fedprox_keeps_partial_work_cut_by_the_deadline(run: Path) -> None:
    d = per_device(run)
    assert float(d[3]["trained"]) == 2 and float(d[3]["partial"]) == 2
    assert float(d[3]["steps"]) == 4  # the client honoured its step budget: 2 steps a round
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["clients_succeeded"] for m in metrics[1:]] == [4, 4]
    assert [m["clients_dropped"] for m in metrics[1:]] == [0, 0]  # the partial work counted


def test_memory_fit_excludes_one_device_and_shrinks_another_s_batch(run: Path) -> None:
    d = per_device(run)
    assert d[5]["excluded_memory"] == "True" and float(d[5]["selected"]) == 0
    assert d[6]["batch"] == "2" and float(d[6]["trained"]) == 2 and float(d[6]["steps"]) == 8
    summary = json.loads((run / "devices" / "summary.json").read_text())
    assert summary["excluded_memory"] == 1 and summary["dropped"]["memory"] == 1
    assert summary["smaller_batch_memory"] == 1
    assert summary["simulated_hours"] == pytest.approx(4.8 / 3600, abs=1e-9)
    assert (run / "devices" / "perplexity_hours.png").stat().st_size > 0
