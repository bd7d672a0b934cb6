"""Round metrics of a federation to a TensorBoard log directory (`tensorboard --logdir runs/`).

The writer lives in :mod:`server.tracking` (every ServerApp run uses it); re-exported here
for the demo's own per-label logs.
"""

from __future__ import annotations

from server.tracking import RoundScalars

__all__ = ["RoundScalars"]
