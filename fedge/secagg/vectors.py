"""Vector arithmetic of SecAgg+: flattening, stochastic quantization and AES-CTR masks."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from numpy.typing import NDArray

FloatVec = NDArray[np.float64]
IntVec = NDArray[np.uint32]  # values mod m <= 2**32; uint32 wrap-around is arithmetic mod 2**32


@dataclass(frozen=True)
class Layout:
    """Order, shapes and scales of the named arrays that make one flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    scales: tuple[float, ...]

    @functools.cached_property
    def size(self) -> int:
        """Number of scalars in the flat vector (cached: masking asks once per neighbour)."""
        return int(sum(int(np.prod(s)) for s in self.shapes))

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray], scales: Mapping[str, float]) -> Layout:
        """Build the layout of `arrays` in sorted-name order, so every party agrees on it."""
        names = tuple(sorted(arrays))
        return cls(
            names=names,
            shapes=tuple(tuple(np.shape(arrays[n])) for n in names),
            scales=tuple(scale_for(n, scales) for n in names),
        )

    def flatten(self, arrays: Mapping[str, np.ndarray]) -> FloatVec:
        """Concatenate `arrays` (divided by their scales) into one float64 vector."""
        if set(arrays) != set(self.names):
            raise ValueError(f"arrays {sorted(arrays)} do not match layout {list(self.names)}")
        parts = []
        for name, shape, scale in zip(self.names, self.shapes, self.scales, strict=True):
            arr = np.asarray(arrays[name], dtype=np.float64)
            if arr.shape != shape:
                raise ValueError(f"array {name!r} has shape {arr.shape}, layout says {shape}")
            parts.append(arr.reshape(-1) / scale if scale != 1.0 else arr.reshape(-1))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)

    def split(self, vec: np.ndarray) -> dict[str, np.ndarray]:
        """Split a flat vector into named arrays of the layout's shapes, unscaled."""
        out: dict[str, np.ndarray] = {}
        offset = 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = int(np.prod(shape))
            out[name] = vec[offset : offset + n].reshape(shape)
            offset += n
        return out

    def unflatten(self, vec: FloatVec) -> dict[str, np.ndarray]:
        """Split a flat vector back into named arrays, multiplying the scales back in."""
        out: dict[str, np.ndarray] = {}
        offset = 0
        for name, shape, scale in zip(self.names, self.shapes, self.scales, strict=True):
            n = int(np.prod(shape))
            out[name] = (vec[offset : offset + n] * scale).reshape(shape)
            offset += n
        return out


def scale_for(name: str, scales: Mapping[str, float]) -> float:
    """Divisor of array ``name``: an exact entry, else the longest entry ending in '/' that prefixes it."""
    if name in scales:
        return float(scales[name])
    prefixes = [p for p in scales if p.endswith("/") and name.startswith(p)]
    return float(scales[max(prefixes, key=len)]) if prefixes else 1.0


def quantize(vec: FloatVec, clip: float, levels: int, rng: np.random.Generator) -> IntVec:
    """Map values in [-clip, clip] to integers in [0, levels] by unbiased stochastic rounding.

    floor(x + u) with u uniform in [0, 1) is floor(x) + 1 with probability frac(x): unbiased.
    Built on the uniform array in place, it costs a third of the textbook version.
    """
    scaled = rng.random(vec.shape)
    scaled += np.clip(vec, -clip, clip) * (levels / (2.0 * clip))
    scaled += levels / 2.0
    return scaled.astype(np.uint32)  # truncation is floor here: every value is >= 0


def dequantize_sum(total: IntVec, num_summed: int, clip: float, levels: int) -> FloatVec:
    """Invert `quantize` on a sum of `num_summed` quantized vectors (already reduced mod m)."""
    return total.astype(np.float64) * (2.0 * clip / levels) - num_summed * clip


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    """The AES-CTR plaintext, reused: allocating it for every mask cost 4x the cipher itself."""
    return bytes(nbytes)


def prg_mask(seed: bytes, length: int, modulus: int) -> IntVec:
    """Expand `seed` into `length` uniform integers mod `modulus` with AES-256 in CTR mode."""
    key = hashlib.sha256(b"fedge-secagg-mask" + seed).digest()
    encryptor = Cipher(algorithms.AES(key), modes.CTR(b"\x00" * 16)).encryptor()
    words = np.frombuffer(encryptor.update(_zeros(4 * length)), dtype="<u4")
    return words if modulus == 2**32 else words & np.uint32(modulus - 1)
