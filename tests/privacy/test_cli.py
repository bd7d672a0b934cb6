"""`fedge privacy plan` and `fedge privacy report`."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.privacy.accounting import gaussian_epsilon


def test_plan_prints_rdp_and_pld_epsilon_per_round() -> None:
    # Prepare
    want = []
    for r in (1, 2):
        for method in ("rdp", "pld"):
            want.append(f"{gaussian_epsilon([0.9] * r, 1e-5, method):.3f}")  # type: ignore[arg-type]
    # Execute
    result = CliRunner().invoke(
        app, ["privacy", "plan", "--noise-multiplier", "0.9", "--rounds", "2"]
    )
    # Assert
    assert result.exit_code == 0, result.output
    assert all(w in result.output for w in want)


def test_report_reads_a_run_directory(tmp_path: Path) -> None:
    # Prepare
    rows = [
        {"round": 0, "status": "ok", "epsilon": 0.0, "dp_sgd_epsilon": None, "perplexity": 230.0},
        {"round": 1, "status": "ok", "epsilon": 6.123, "dp_sgd_epsilon": None, "perplexity": 228.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "status.json").write_text(json.dumps({"status": "budget", "message": "stopped"}))
    # Execute
    result = CliRunner().invoke(app, ["privacy", "report", str(tmp_path)])
    # Assert
    assert result.exit_code == 0, result.output
    assert "6.123" in result.output and "228.500" in result.output and "stopped" in result.output


def test_report_names_a_missing_run_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["privacy", "report", str(tmp_path / "nope")])
    assert result.exit_code != 0
    assert "does not exist" in result.output
