"""MLflow tracking (the `mlflow` config key): rounds written to a local store read back as written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedge.server.config import RunConfig
from fedge.server.tracking import MLFLOW_DIR, round_trackers

ROWS = [
    {"round": 0, "eval_loss": 5.0, "status": "ok", "resumed": False},
    {"round": 1, "eval_loss": 4.0, "epsilon": math.nan, "clients_succeeded": 3},
    {"round": 2, "eval_loss": 3.5, "clients_succeeded": 2},
]


def test_rounds_go_to_a_local_mlflow_store_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlflow = "local"`: one FINISHED run in <run-dir>/mlruns whose metric histories are the
    rows' finite numbers at step = round (text, booleans and NaN left out), params the config."""
    mlflow = pytest.importorskip(
        "mlflow", reason="the mlflow extra is not installed: pip install 'fedge[mlflow]'"
    )
    # Prepare
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, so teardown restores it
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # "local" opts in to the file store by itself
    run_dir = tmp_path / "run-a"
    params = {"strategy": "scaffold", "num-server-rounds": 2}
    (tracker,) = round_trackers(run_dir, tensorboard=False, mlflow="local", params=params)
    assert not (run_dir / MLFLOW_DIR).exists()  # opened at the first row, never before
    run_dir.mkdir()
    # Execute
    for row in ROWS:
        tracker(row)
    tracker.close(failed=False)
    # Assert: read back with MLflow's own client from the file in the run directory
    client = mlflow.tracking.MlflowClient(tracking_uri=(run_dir / MLFLOW_DIR).as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("fedge").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.params == {"strategy": "scaffold", "num-server-rounds": "2"}
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in run.data.metrics
    }
    assert history == {
        "eval_loss": [(0, 5.0), (1, 4.0), (2, 3.5)],
        "clients_succeeded": [(1, 3.0), (2, 2.0)],
    }


def test_a_bad_mlflow_setting_is_refused_naming_the_key() -> None:
    """Neither off, local nor a URI: the config error names the key and the accepted forms."""
    with pytest.raises(ValueError, match="mlflow must be"):
        RunConfig.from_mapping({"mlflow": "yes"})
    assert RunConfig.from_mapping({"mlflow": "sqlite:///x.db"}).mlflow == "sqlite:///x.db"
