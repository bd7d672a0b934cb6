"""The demo's report (Markdown + plots) and its TensorBoard round scalars, read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedge.server.rundir import MetricsLog
from fedge.server.tracking import RoundScalars
from fedge.simulations.report import write_report


def _federation(
    run_dir: Path, label: str, ppl: list[float], eps: float | None, seen: list[int]
) -> dict[str, Any]:
    log = MetricsLog(run_dir)
    for i, p in enumerate(ppl):
        log.append({"round": i, "status": "ok", "perplexity": p, "participants_perplexity": p - 5})
    return {
        "label": label,
        "run_dir": str(run_dir),
        "adapter_dir": str(run_dir / "final" / "adapter"),
        "partitions": seen,
        "clients": 3,
        "participating_perplexity": [ppl[0] - 5, ppl[-1] - 5],
        "corpus_perplexity": [ppl[0], ppl[-1]],
        "epsilon": eps,
    }


def _population(tmp_path: Path) -> dict[str, Any]:
    def run(label: str, after: float, eps: float | None) -> dict[str, Any]:
        return {
            "label": label,
            "run_dir": str(tmp_path / label),
            "population": 500,
            "cohort": 50,
            "mean_cohort": 49.5,
            "rounds": 4,
            "participating": [50.0, after],
            "epsilon": eps,
            "epsilon_server": 18.8 if eps else None,
            "delta": 0.002 if eps else None,
            "accountant": "pld" if eps else None,
            "simulated_hours": 0.1,
            "wall_seconds": 60.0,
        }

    return {
        "plain": run("plain", 48.0, None),
        "private": run("secagg+dp", 48.5, 4.9),
        "seconds": 121.0,
    }


def test_report_carries_every_stage_and_its_plots(tmp_path: Path) -> None:
    card = {
        "preset": "demo",
        "target": {"parameters": 529_000, "training_tokens": 819_200, "heldout_perplexity": 91.8},
        "draft": {"parameters": 181_000, "training_tokens": 512_000, "heldout_perplexity": 141.0},
        "agreement": {"greedy_rate": 0.683, "tokens_per_verify_draft4": 2.59},
    }
    summary = {
        "preset": "demo",
        "run_dir": str(tmp_path),
        "seconds": 300.0,
        "timings_s": {"zoo": 1.0, "federation": 100.0},
        "stages": {
            "zoo": {"card": card},
            "federation": {
                "plain": _federation(tmp_path / "plain", "plain", [70.0, 60.0], None, [0, 1, 2]),
                # SecAgg+ masks per-client metrics: the server sees how many, not which
                "private": _federation(tmp_path / "private", "secagg+dp", [70.0, 69.0], 3.25, []),
            },
            "population": _population(tmp_path),
            "realignment": {
                "clients": [
                    {
                        "partition": 0,
                        "base_vs_base": 0.6,
                        "base_vs_federated": 0.5,
                        "realigned_vs_federated": 0.65,
                    },
                    {
                        "partition": 1,
                        "base_vs_base": 0.5,
                        "base_vs_federated": 0.4,
                        "realigned_vs_federated": 0.55,
                    },
                ]
            },
            "edge": {
                "draft_runtime": "onnx-int4",
                "decode_step_ms": {"fp32": 0.4, "int4": 0.2},
                "acceptance": 0.61,
                "passes_per_token": 0.4,
                "speculative_tokens_per_s": 120.0,
                "cloud_only_tokens_per_s": 80.0,
                "greedy_identical": True,
            },
        },
    }
    report = write_report(summary, tmp_path).read_text()
    assert "| plain | 3 | 65.00 -> 55.00 (-15.4%) | 70.00 -> 60.00 (-14.3%) | - |" in report
    assert "| secagg+dp | 3 | 65.00 -> 64.00 (-1.5%) | 70.00 -> 69.00 (-1.4%) | 3.25 |" in report
    assert (
        "| 500 phones, secagg+dp | 49.5 | 50.00 -> 48.50 (-3.0%) | 4.90 (1/500) | 0.10 |" in report
    )
    assert "+1.0% (kept 75% of the plain run's -4.0%) with Poisson cohorts of K = 50" in report
    assert "| 0 | 60.0% | 50.0% | 65.0% |" in report
    assert "| mean | 55.0% | 45.0% | 60.0% |" in report
    assert "int4 0.200 ms (2.00x fp32)" in report and "| yes |" in report
    for plot in ("perplexity_rounds.png", "acceptance.png"):
        assert (tmp_path / plot).stat().st_size > 1000 and f"]({plot})" in report


def test_round_scalars_are_readable_by_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RoundScalars(tmp_path) as scalars:
        scalars({"round": 0, "perplexity": 70.0, "status": "ok", "epsilon": None})
        scalars({"round": 1, "perplexity": 60.0, "status": "ok", "flag": True})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["round/perplexity"]
    assert [(e.step, e.value) for e in events.Scalars("round/perplexity")] == [(0, 70.0), (1, 60.0)]


def test_report_keeps_a_client_too_short_to_measure(tmp_path: Path) -> None:
    """A realignment row with null rates (no held-out code to measure) is listed as n/a.

    The demo's first run with a row per client crashed here: the plot added None to a bar.
    """
    from fedge.simulations.report import _plot_acceptance, _realignment_section

    clients = [
        {
            "partition": 0,
            "prompt_tokens": 0,
            "base_vs_base": None,
            "base_vs_federated": None,
            "realigned_vs_federated": None,
        },
        {
            "partition": 1,
            "prompt_tokens": 32,
            "base_vs_base": 0.5,
            "base_vs_federated": 0.4,
            "realigned_vs_federated": 0.7,
        },
    ]
    lines = _realignment_section(clients, "acceptance.png")
    assert "| 0 | n/a | n/a | n/a |" in lines
    assert "| mean | 50.0% | 40.0% | 70.0% |" in lines
    assert _plot_acceptance(clients, tmp_path / "acceptance.png") == "acceptance.png"
    assert (tmp_path / "acceptance.png").stat().st_size > 0
