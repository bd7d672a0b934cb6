"""The demo's population stage, run for real at a tiny size and read back into the report."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from fedge.server.rundir import MetricsLog, read_config
from fedge.simulations.demo_population import population_stage
from fedge.simulations.report import population_section
from tests.simulations.federations import TINY_TRAINING

PHONES = 12
TINY = {
    **TINY_TRAINING,
    "num-server-rounds": 1,
    # Poisson cohorts from OS randomness (as the accountant assumes): with 4 expected of 12 a
    # draw under the scenario's min-train-nodes = 2 came about one run in 20 (seen in CI);
    # with 8 expected it comes about once in 20,000
    "target-reports": 8,
    "dp-target-delta": 1 / PHONES,
    "max-chars-per-client": 20000,
    "lora-target-modules": "q_proj,v_proj",
}


def test_the_population_section_shows_what_the_runs_wrote(micro_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Both arms (plain, SecAgg+ with distributed DP) of 12 micro-zoo phones run one round; the
    report's section carries each run's participants' perplexity, epsilon at delta = 1/12,
    the server's unamplified epsilon and simulated hours exactly as its run directory holds
    them, and sets the population's privacy cost beside the 6-client run's."""
    from fedge.privacy.accounting import gaussian_epsilon

    stage = population_stage(
        str(micro_zoo.target_dir),
        tmp_path,
        Console(file=io.StringIO()),
        overrides=TINY,
        population=PHONES,
    )
    small = {  # the 6-client runs' figures as the demo's federation stage hands them over
        "plain": {"label": "plain", "clients": 6, "participating_perplexity": [60.0, 57.0]},
        "private": {
            "label": "secagg+dp",
            "clients": 6,
            "participating_perplexity": [60.0, 61.0],
            "epsilon": 25.9,
        },
    }
    small["plain"]["epsilon"] = None
    section = "\n".join(population_section(small, stage))

    for arm, run_dir in (("plain", tmp_path / "plain"), ("private", tmp_path / "secagg-dp")):
        rows = MetricsLog(run_dir).rows()
        first, last = rows[0]["participants_perplexity"], rows[-1]["participants_perplexity"]
        hours = json.loads((run_dir / "devices" / "summary.json").read_text())["simulated_hours"]
        label = stage[arm]["label"]
        assert f"| {PHONES} phones, {label} |" in section
        assert f"{first:.2f} -> {last:.2f} ({(last - first) / first:+.1%})" in section
        assert f"| {hours:.2f} |" in section
    private_rows = MetricsLog(tmp_path / "secagg-dp").rows()
    epsilon = private_rows[-1]["epsilon"]
    z = float(read_config(tmp_path / "secagg-dp")["dp-noise-multiplier"])
    server_view = gaussian_epsilon([z], 1 / PHONES, "pld")
    assert 0 < epsilon < server_view
    assert f"{epsilon:.2f} (1/{PHONES})" in section
    assert f"unamplified {server_view:.2f}" in section
    assert stage["plain"]["epsilon"] is None and "| -" in section
    assert "with 6 clients per round" in section
    plain_after = MetricsLog(tmp_path / "plain").rows()[-1]["participants_perplexity"]
    cost = (private_rows[-1]["participants_perplexity"] - plain_after) / plain_after
    assert f"{cost:+.1%}" in section
    assert stage["private"]["mean_cohort"] == pytest.approx(private_rows[-1]["clients_sampled"])
