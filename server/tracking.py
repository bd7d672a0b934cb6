"""Experiment tracking of every run: each round's metrics row as TensorBoard scalars, and
optionally as MLflow metrics.

The ServerApp (:mod:`fedge.server.app`) writes ``<run-dir>/tensorboard`` in every run, under
``flwr run``, ``fedge simulate`` and the demo alike (``tensorboard = false`` turns it off);
view it with ``tensorboard --logdir <run-dir>/tensorboard``. With ``mlflow = "local"`` it
also logs to MLflow's local file store in the run directory (``<run-dir>/mlruns``; view it
with ``mlflow ui --backend-store-uri <run-dir>/mlruns``), or with any other value to that
tracking URI (e.g. ``sqlite:///path/mlflow.db``, ``http://host:5000``); it needs the
``mlflow`` extra (``mlflow-skinny``). MLflow 3 keeps the file store in maintenance mode and
refuses it unless ``MLFLOW_ALLOW_FILE_STORE`` is true; ``local`` sets that (when unset) for
this process: the file store opens in milliseconds, a new SQLite store took 6 s here.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MLFLOW_LOCAL = "local"  # `mlflow = "local"`: MLflow's file store in the run directory
MLFLOW_DIR = "mlruns"
MLFLOW_FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"
MLFLOW_EXPERIMENT = "fedge"
MLFLOW_EXTRA = "pip install 'fedge[mlflow]' (mlflow-skinny)"


def numeric_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's finite numbers other than ``round`` (booleans and text are not metrics)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "round"
        and not isinstance(v, bool)
        and isinstance(v, (int, float))
        and math.isfinite(v)
    }


class RoundScalars:
    """A `SummaryWriter` fed one metrics row per round: every finite number becomes a scalar."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def __call__(self, row: Mapping[str, Any]) -> None:
        """Write the row's numeric metrics at step = its round."""
        step = int(row["round"])
        for key, value in numeric_metrics(row).items():
            self.writer.add_scalar(f"round/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

    def __enter__(self) -> RoundScalars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mlflow_uri(setting: str, run_dir: Path) -> str:
    """The tracking URI ``mlflow`` names: ``local`` is the file store in the run directory."""
    if setting == MLFLOW_LOCAL:
        os.environ.setdefault(MLFLOW_FILE_STORE_ENV, "true")  # the user asked for the file store
        return (run_dir / MLFLOW_DIR).resolve().as_uri()
    return setting


def require_mlflow() -> None:
    """Fail before the run, naming the extra, when ``mlflow`` is set but not installed."""
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError(f"config mlflow is set, but MLflow is not installed: {MLFLOW_EXTRA}")


class MlflowRounds:
    """One MLflow run per ServerApp start: the run config as params, each round's row as metrics
    (step = round); closed as FINISHED or FAILED with the federation's outcome."""

    def __init__(self, tracking_uri: str, run_name: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        experiment = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(MLFLOW_EXPERIMENT)
        )
        self.run_id: str = self.client.create_run(experiment, run_name=run_name).info.run_id
        self.client.log_batch(
            self.run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        )

    def __call__(self, row: Mapping[str, Any]) -> None:
        """Log the row's numeric metrics at step = its round."""
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["round"])
        metrics = [Metric(k, v, now, step) for k, v in numeric_metrics(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str = "FINISHED") -> None:
        """End the MLflow run (``FINISHED`` or ``FAILED``)."""
        self.client.set_terminated(self.run_id, status=status)


class LazyTracker:
    """A tracker opened at the first row, after the loop has archived an earlier run's outputs
    (``fedge.server.checkpoint.RUN_OUTPUTS``), never before; ``close`` passes the run's outcome."""

    def __init__(self, open_tracker: Callable[[], Any]) -> None:
        self._open = open_tracker
        self._tracker: Any = None

    def __call__(self, row: Mapping[str, Any]) -> None:
        """Open the tracker if needed and hand it the row."""
        if self._tracker is None:
            self._tracker = self._open()
        self._tracker(row)

    def close(self, failed: bool = False) -> None:
        """Close the tracker if one was opened."""
        if isinstance(self._tracker, MlflowRounds):
            self._tracker.close("FAILED" if failed else "FINISHED")
        elif self._tracker is not None:
            self._tracker.close()


def round_trackers(
    run_dir: Path, tensorboard: bool, mlflow: str, params: Mapping[str, Any]
) -> list[LazyTracker]:
    """The trackers a run's config asks for (TensorBoard by default, MLflow as an option)."""
    trackers = []
    if tensorboard:
        trackers.append(LazyTracker(lambda: RoundScalars(run_dir / "tensorboard")))
    if mlflow:
        require_mlflow()
        uri = mlflow_uri(mlflow, run_dir)
        trackers.append(LazyTracker(lambda: MlflowRounds(uri, run_dir.name, params)))
    return trackers
