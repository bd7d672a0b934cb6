"""Randomness of the DP mechanisms: drawn from the operating system's CSPRNG, never from a seed.

A DP guarantee only holds while the noise (and the secret sampling the accountant
assumes) is unpredictable to the adversary. A seed from the run config, the round
and the partition is known to the server and to anyone holding ``config.json``, so
every DP mechanism of fedge takes its randomness from here instead; seeds stay
for non-private runs, which must be reproducible.
"""

from __future__ import annotations

import os

import numpy as np

_TWO_PI = 2.0 * np.pi
_UNIT = 2.0**-53  # spacing of the 53-bit uniforms below


def _uniform53(count: int) -> np.ndarray:
    """``count`` uniforms in (0, 1] with 53 random bits each, from ``os.urandom``."""
    raw = np.frombuffer(os.urandom(8 * count), dtype="<u8") >> np.uint64(11)
    return (raw.astype(np.float64) + 1.0) * _UNIT


def secure_normal(shape: tuple[int, ...], std: float) -> np.ndarray:
    """N(0, std^2) samples (float64) by Box-Muller over OS-entropy uniforms.

    Every call reads fresh bytes from the OS CSPRNG, so no seed can reproduce the
    noise. Like Opacus' secure mode (arXiv:2107.10138), each sample is the sum of
    four draws divided by two, which blunts floating-point attacks on the tails.
    """
    if std < 0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    size = int(np.prod(shape, dtype=np.int64))
    if std == 0 or size == 0:
        return np.zeros(shape, dtype=np.float64)
    pairs = (4 * size + 1) // 2
    radius = np.sqrt(-2.0 * np.log(_uniform53(pairs)))
    angle = _TWO_PI * _uniform53(pairs)
    draws = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[: 4 * size]
    return (draws.reshape(4, size).sum(axis=0) / 2.0 * std).reshape(shape)
