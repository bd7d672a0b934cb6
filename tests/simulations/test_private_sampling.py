"""A real private federation whose cohort is drawn as its accountant assumes (in-process, micro zoo)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedge.server.app import OutcomeBox, make_server_app
from fedge.server.config import RunConfig
from fedge.server.sampling import sampled_epsilon
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.simulations.runner import client_roots
from tests.simulations.federations import CONFIG, client_app

PRIVATE = {
    **CONFIG,
    "strategy": "fedavg",
    "weighting": "uniform",
    "aggregator": "fedge.server.privacy.factories:central_dp",
    "dp-noise-multiplier": 1.0,
    "dp-clip-norm": 0.5,
    "dp-target-delta": 0.125,  # 1 / population
    "fraction-train": 0.5,  # K = 4 of the 8 devices
    "num-server-rounds": 3,
    "min-train-nodes": 1,
}


def test_a_poisson_cohort_is_accounted_at_its_sampling_rate(micro_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``privacy-sampling = "poisson"``: every round each of the 8 eligible devices joins with
    q = 4 / 8, and epsilon after round r is that of r Poisson-subsampled Gaussian releases at
    q = 0.5, below the unamplified figure. On main the key was ignored: cohorts were the
    seeded first-K and epsilon the full release's: 3.69 against 1.72 after 3 rounds here)."""
    from fedge.lm import holder
    from fedge.server.rundir import MetricsLog

    cfg = RunConfig.from_mapping(
        {
            **PRIVATE,
            "privacy-sampling": "poisson",
            "run-dir": str(tmp_path / "run"),
            "client-state-dir": str(tmp_path / "cs"),
        }
    )
    grid = InProcessGrid(client_app(), DeviceTable(8), tmp_path / "state")
    box = OutcomeBox()
    holder.configure_threads(0)
    with client_roots(cfg):  # the test runs every node: their roots hold its paths
        run_inprocess(make_server_app(cfg, box=box), grid)
    assert box.outcome is not None and box.outcome.status == "completed", box.outcome
    rows = MetricsLog(tmp_path / "run").rows()[1:]
    for r, row in enumerate(rows, 1):
        expected = sampled_epsilon("poisson", [(8, 4)] * r, 1.0, 0.125, "rdp")
        assert row["epsilon"] == pytest.approx(expected)
        assert 1 <= row["clients_sampled"] <= 8
    from fedge.privacy.accounting import gaussian_epsilon

    assert rows[-1]["epsilon"] < gaussian_epsilon([1.0] * 3, 0.125, "rdp")
    assert np.isfinite(rows[-1]["eval_loss"])
