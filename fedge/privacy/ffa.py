"""FFA-LoRA under DP (Sun et al. 2024, arXiv:2403.12313): lora_A frozen, only B is released.

With every client's ``lora_A`` frozen at the shared global value, its deltas are exactly
zero, so the privacy mechanisms treat those keys as public zeros: they are forced to zero,
get no noise (the global A stays fixed) and SecAgg+ does not upload them at all, which
halves the masked bytes of a LoRA adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from fedge.privacy.mechanism import is_sensitive
from fedge.privacy.wire import KEY_DP_ACTIVE, KEY_DPSGD_NOISE
from fedge.types import Arrays

KEY_FFA = "dp-ffa-lora"  # auto (on under any DP) | on | off


def ffa_enabled(config: Mapping[str, object]) -> bool:
    """Whether lora_A is frozen this round, from ``dp-ffa-lora`` and whether DP is active."""
    mode = str(config.get(KEY_FFA, "auto")).lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"config key '{KEY_FFA}' must be auto, on or off, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return float(str(config.get(KEY_DPSGD_NOISE, 0.0))) > 0 or bool(
        config.get(KEY_DP_ACTIVE, False)
    )


def frozen_keys(names: Iterable[str]) -> list[str]:
    """The contribution keys FFA-LoRA freezes: sensitive (delta/, ctrl/) ``lora_A`` tensors."""
    return sorted(n for n in names if is_sensitive(n) and "lora_A" in n)


def zero_frozen(contribution: Arrays) -> Arrays:
    """Force the frozen keys to zero (a client that trained A anyway releases nothing of it)."""
    frozen = set(frozen_keys(contribution))
    return {k: np.zeros_like(v) if k in frozen else v for k, v in contribution.items()}
