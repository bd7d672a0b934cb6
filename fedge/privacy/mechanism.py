"""The Gaussian mechanism on contributions: clip the sensitive part, noise the sensitive sum."""

from __future__ import annotations

import math

import numpy as np

from fedge import keys
from fedge.privacy.randomness import secure_normal
from fedge.privacy.wire import (
    DEFAULT_METRIC_CLIP,
    DEFAULT_METRIC_NOISE_SCALE,
    KEY_DP_METRIC_CLIP,
    KEY_DP_METRIC_NOISE,
)
from fedge.types import Arrays


def is_sensitive(name: str) -> bool:
    """Whether a contribution key carries private signal (``delta/`` and ``ctrl/``)."""
    return name.startswith(keys.SENSITIVE_PREFIXES)


def sensitive_norm(contribution: Arrays) -> float:
    """Joint L2 norm of all sensitive arrays of one contribution."""
    total = sum(
        float(np.sum(np.square(v, dtype=np.float64)))
        for k, v in contribution.items()
        if is_sensitive(k)
    )
    return math.sqrt(total)


def clip_contribution(contribution: Arrays, clip_norm: float) -> tuple[Arrays, float]:
    """Scale the sensitive arrays so their joint L2 norm is at most ``clip_norm``.

    Returns the clipped contribution (float32, same keys) and the norm before clipping.
    Public ``meta/`` keys are left as they are.
    """
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    norm = sensitive_norm(contribution)
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    out = {
        k: (np.asarray(v, dtype=np.float64) * factor).astype(np.float32) if is_sensitive(k) else v
        for k, v in contribution.items()
    }
    return out, norm


def add_gaussian_noise(summed: Arrays, std: float, skip: frozenset[str] = frozenset()) -> Arrays:
    """Add i.i.d. N(0, std^2) noise to every sensitive array of a sum, except ``skip`` keys.

    The noise comes from the OS CSPRNG (:func:`fedge.privacy.randomness.secure_normal`), so
    no seed, config or file reproduces it. ``skip`` holds keys known to be zero for every
    client (FFA-LoRA's frozen lora_A): they carry no data, so they need no noise. Output is
    float32.
    """
    if std < 0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    return {
        k: (np.asarray(v, dtype=np.float64) + secure_normal(np.shape(v), std)).astype(np.float32)
        if is_sensitive(k) and k not in skip
        else v
        for k, v in summed.items()
    }


def loss_release_settings(config: object) -> tuple[float, float]:
    """(L, k) of the training-loss release from a message config: L = ``dp-metric-clip``
    (0, the loss kept home, when it is not a finite positive number) and k =
    ``dp-metric-noise-scale`` (the loss's noise multiplier is k z; below 1 or not a
    number it is raised to 1, more noise than asked, never less)."""
    get = getattr(config, "get", None)
    values = []
    for key, default in (
        (KEY_DP_METRIC_CLIP, DEFAULT_METRIC_CLIP),
        (KEY_DP_METRIC_NOISE, DEFAULT_METRIC_NOISE_SCALE),
    ):
        raw = get(key, default) if get is not None else default
        try:
            values.append(float(str(raw)) if not isinstance(raw, bool) else math.nan)
        except ValueError:
            values.append(math.nan)
    clip, scale = values
    clip = clip if math.isfinite(clip) and clip > 0 else 0.0
    scale = scale if math.isfinite(scale) and scale >= 1 else 1.0
    return clip, scale


def noised_loss(value: float, clip: float, std: float) -> float:
    """One client's loss through the Gaussian mechanism: clipped into [0, ``clip``] (a
    non-finite loss counts as ``clip``), plus N(0, std^2) from the OS CSPRNG.

    Any change of the client's data moves the clipped loss by at most ``clip``, so
    ``std / clip`` is the release's noise multiplier, accounted like an update's.
    """
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"loss clip must be finite and > 0, got {clip}")
    clipped = min(clip, max(0.0, value)) if math.isfinite(value) else clip
    return float(clipped + secure_normal((1,), std)[0])
