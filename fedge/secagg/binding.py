"""One canonical digest of everything a client's contribution depends on.

A SecAgg+ sum is only as private as the assumption that every client computed its input
under the same round: the same global model and strategy state, the same config, the
same protocol numbers (clipping range, quantization range, modulus, scales, omitted
keys), the same neighbourhood graph and thresholds, round, key session and run. A server
that sends one client different numbers than the others (``clipping-range = 1e30`` to all
but the victim: their inputs quantize to exactly zero and the sum is the victim's input)
breaks that assumption without breaking any single message's rules. So a client derives
every pairwise mask seed over :func:`contribution_digest` of the message it was sent
(:func:`fedge.secagg.crypto.mask_info`): two clients sent anything different derive
different pair seeds, their masks do not cancel, and the server's "sum" is uniform noise,
never one input.

The digest is canonical, so that two messages a client treats identically give one
digest and two it treats differently give two:

* record and key order do not matter (sorted, length-prefixed, typed);
* numbers are mathematical values: an int and the float of the same value are one
  number, ``-0.0`` is ``0.0`` and every NaN is one NaN (a client computes the same with
  either); floating arrays are hashed as their exact values (float32 when every value fits,
  else float64), so a float32 array and its float64 copy are one model, and ``-0.0`` / NaN payloads in an array fold the same way;
* nothing is skipped: a record or field the client does not know is covered (it changes
  the digest), except the per-client SecAgg+ fields (:data:`PER_CLIENT_FIELDS`), which
  differ between honest clients and are bound otherwise: the neighbour list and threshold
  through the round's whole graph (:data:`fedge.secagg.wire.KEY_GRAPH`, the same for every
  client and covered here), the neighbours' keys through the key agreement itself.

The digest has three parts: ``model`` (every ArrayRecord: global model and strategy
state), ``config`` (every other record but the SecAgg+ one) and ``protocol`` (the SecAgg+
record but its per-client fields, plus the run id). ``whole`` binds the three and is what
the mask keys use; ``once-per-model`` keys on ``model`` (a fresh round id or a changed
config is the same global model; what must not train twice is the model,
:func:`fedge.clients.privacy.policy.check_train`).
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedge.secagg import wire

VERSION = b"fedge contribution digest v2"
# SecAgg+ fields that differ between honest clients of one round; bound otherwise (above).
PER_CLIENT_FIELDS = frozenset(
    {
        wire.KEY_NEIGHBOURS,
        wire.KEY_THRESHOLD,
        wire.KEY_PEER_PK1,
        wire.KEY_PEER_PK2,
        wire.KEY_PEER_IDENTITY,
        wire.KEY_PEER_SIGNATURE,
    }
)


@dataclass(frozen=True)
class ContributionDigest:
    """The three parts of the digest and the whole that binds them (32 bytes each)."""

    model: bytes
    config: bytes
    protocol: bytes

    @property
    def whole(self) -> bytes:
        """What every pairwise mask seed is derived over."""
        return hashlib.sha256(VERSION + self.model + self.config + self.protocol).digest()


def contribution_digest(content: RecordDict, run_id: int | None = None) -> ContributionDigest:
    """The canonical digest of a train / collect message ``content`` (see the module doc)."""
    model = hashlib.sha256(b"model")
    config = hashlib.sha256(b"config")
    protocol = hashlib.sha256(b"protocol")
    protocol.update(_value(run_id if run_id is not None else "no-run"))
    for name in sorted(content):
        record = content[name]
        tag = _blob(f"{type(record).__name__}:{name}".encode())
        if isinstance(record, ArrayRecord):
            model.update(tag)
            for key in sorted(record):
                model.update(_blob(key.encode()) + array_bytes(record[key]))
        elif name == wire.SECAGG_RECORD:
            protocol.update(tag)
            for key in sorted(record):
                if key not in PER_CLIENT_FIELDS:
                    protocol.update(_blob(key.encode()) + _value(record[key]))  # type: ignore[index]
        else:
            config.update(tag)
            for key in sorted(record):
                config.update(_blob(key.encode()) + _value(record[key]))  # type: ignore[index]
    return ContributionDigest(model.digest(), config.digest(), protocol.digest())


def model_digest(content: RecordDict) -> str:
    """Hex of the ``model`` part alone: what ``once-per-model`` records in the ledger."""
    return contribution_digest(content).model.hex()


def array_bytes(arr: Array) -> bytes:
    """An array as shape and canonical values (see the module doc), never its wire bytes."""
    if arr.stype != "numpy.ndarray":  # not a format this library decodes: its exact bytes
        return _blob(f"raw|{arr.stype}|{arr.dtype}|{tuple(arr.shape)}".encode()) + _blob(arr.data)
    a = _view(arr)
    kind = a.dtype.kind
    if kind == "f":
        v = _float_values(a)
        canon = "f"
    elif kind == "c":
        v = a.astype("<c16") + 0.0
        v.real[np.isnan(v.real)] = np.nan
        v.imag[np.isnan(v.imag)] = np.nan
        canon = "c"
    elif kind in "iu":
        v, canon = a.astype("<i8" if kind == "i" else "<u8", copy=False), kind
    elif kind == "b":
        v, canon = a.astype("u1", copy=False), "b"
    else:  # strings, objects: their dtype and bytes as numpy holds them
        v, canon = a, a.dtype.str
    body = np.ascontiguousarray(v)
    return (
        _blob(f"{canon}{body.dtype.itemsize}|{a.shape}".encode())
        + hashlib.sha256(body.data).digest()
    )


def _view(arr: Array) -> np.ndarray:
    """The array inside a numpy-serialized Array, read in place (no copy) when it is a C-order
    .npy payload; else decoded as Flower decodes it."""
    data = arr.data
    try:
        header = io.BytesIO(data[:4096])
        version = np.lib.format.read_magic(header)
        shape, fortran, dtype = np.lib.format._read_array_header(header, version)  # type: ignore[attr-defined]
        if not fortran and not dtype.hasobject:
            count = int(np.prod(shape, dtype=np.int64))
            return np.frombuffer(data, dtype, count, header.tell()).reshape(shape)
    except (ValueError, AttributeError, TypeError):
        pass
    return np.asarray(arr.numpy())


def _float_values(a: np.ndarray) -> np.ndarray:
    """Exact values in the narrowest of float32 / float64 that holds them all (so a float32
    array and its float64 copy agree), -0.0 folded into 0.0, every NaN one NaN."""
    if a.dtype == np.dtype("<f4"):  # the common case: hashed in place unless it must change
        if not np.isnan(a).any() and not (np.signbit(a) & (a == 0)).any():
            return a
        v: np.ndarray = a + np.float32(0.0)
    elif a.dtype.itemsize <= 4:
        v = a.astype("<f4") + np.float32(0.0)  # exact for f2/f4; + 0.0 folds -0.0
    else:
        wide = a.astype("<f8") + 0.0
        narrow = wide.astype("<f4")
        fits = np.array_equal(narrow.astype("<f8"), wide, equal_nan=True)
        v = narrow if fits else wide
    nan = np.isnan(v)
    if nan.any():
        v[nan] = np.nan
    return v


def _blob(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def _value(value: object) -> bytes:
    """A config value, typed and length-prefixed; numbers by value (int 1 == float 1.0)."""
    if isinstance(value, bool):
        return b"B" + (b"1" if value else b"0")
    if isinstance(value, int | float):
        return b"N" + _blob(_number(value).encode())
    if isinstance(value, str):
        return b"S" + _blob(value.encode())
    if isinstance(value, bytes):
        return b"Y" + _blob(value)
    if isinstance(value, list):
        return b"L" + len(value).to_bytes(8, "big") + b"".join(_value(x) for x in value)
    if isinstance(value, Mapping):
        return b"M" + b"".join(_blob(str(k).encode()) + _value(value[k]) for k in sorted(value))
    return b"R" + _blob(repr(value).encode())


def _number(x: int | float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x.is_integer():
        return str(int(x))  # also folds -0.0 into 0
    return x.hex()
