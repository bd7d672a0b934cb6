"""Round metrics of a federation to a TensorBoard log directory (`tensorboard --logdir runs/`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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

    def __enter__(self) -> RoundScalars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.writer.close()
