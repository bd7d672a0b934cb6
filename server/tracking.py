"""Experiment tracking of every run: each round's metrics row as TensorBoard scalars.

The ServerApp (:mod:`server.app`) writes ``<run-dir>/tensorboard`` in every run, under
``flwr run``, ``fedge simulate`` and the demo alike (``tensorboard = false`` turns it off);
view it with ``tensorboard --logdir <run-dir>/tensorboard``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class LazyRoundScalars:
    """:class:`RoundScalars` opened at the first row: after the loop has archived an earlier
    run's ``tensorboard`` folder (``server.checkpoint.RUN_OUTPUTS``), never before."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._scalars: RoundScalars | None = None

    def __call__(self, row: Mapping[str, Any]) -> None:
        """Open the writer if needed and write the row."""
        if self._scalars is None:
            self._scalars = RoundScalars(self.logdir)
        self._scalars(row)

    def close(self) -> None:
        """Close the writer if one was opened."""
        if self._scalars is not None:
            self._scalars.close()


class RoundScalars:
    """A `SummaryWriter` fed one metrics row per round: every finite number becomes a scalar."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def __call__(self, row: Mapping[str, Any]) -> None:
        """Write the row's numeric metrics at step = its round."""
        step = int(row["round"])
        for key, value in row.items():
            if key == "round" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(f"round/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

    def __enter__(self) -> RoundScalars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
