"""Value types shared by every layer: named float arrays and flat config values."""

from __future__ import annotations

import numpy as np

Arrays = dict[str, np.ndarray]
ConfigValue = bool | int | float | str
