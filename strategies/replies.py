"""Reading a train reply as a contribution: fedge's own format or a plain Flower ClientApp's.

Two reply shapes are accepted (both by fedge's round loop and by fedge strategies
running inside a plain Flower ``ServerApp``):

* fedge's: a ``contribution`` ArrayRecord (keys in :mod:`fedge.keys`), as
  :func:`~fedge.strategies.contract.build_contribution` or :mod:`fedge.strategies.client` build it;
* Flower's quickstart shape: ONE ArrayRecord with the locally trained arrays and a
  MetricRecord with the example count (``num-examples``). It becomes the contribution
  ``delta = n * (local - global)``, ``meta/weight = n``, ``meta/count = 1``, so Flower's
  FedAvg and fedge's FedAvg/FedProx agree on it. SCAFFOLD needs the control delta too,
  so it refuses this shape and names the client helper to use.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedge import keys
from fedge.strategies.arrays import array_numpy
from fedge.types import Arrays

ContributionSpec = Mapping[str, tuple[int, ...]]


def contribution_problem(record: ArrayRecord | None, spec: ContributionSpec) -> str | None:
    """Return why a contribution record is unacceptable (None when it is fine).

    Checks, in order: presence, the exact key set, float32 dtype, shape, finiteness.
    """
    return contribution_arrays(record, spec)[1]


def contribution_arrays(
    record: ArrayRecord | None, spec: ContributionSpec
) -> tuple[Arrays | None, str | None]:
    """(The record's arrays, None) or (None, why it is unacceptable), each array parsed once
    (a Flower ``Array`` re-reads its bytes on every ``numpy()``)."""
    if record is None:
        return None, f"reply has no '{keys.REC_CONTRIB}' ArrayRecord"
    got = set(record.keys())
    missing, extra = sorted(set(spec) - got), sorted(got - set(spec))
    if missing or extra:
        return None, f"contribution keys differ: missing {missing[:3]}, unexpected {extra[:3]}"
    arrays: Arrays = {}
    for name, shape in spec.items():
        arr = record[name]
        if arr.dtype != "float32":
            return None, f"'{name}' has dtype {arr.dtype}, expected float32"
        if tuple(arr.shape) != tuple(shape):
            return None, f"'{name}' has shape {tuple(arr.shape)}, expected {tuple(shape)}"
        arrays[name] = array_numpy(arr)
        if not np.isfinite(arrays[name]).all():
            return None, f"'{name}' contains NaN or Inf"
    return arrays, None


def contribution_record(
    content: RecordDict, global_arrays: Arrays, weighted_by_key: str
) -> ArrayRecord | None:
    """The reply's contribution record; a Flower-style reply is converted (None: neither shape)."""
    if keys.REC_CONTRIB in content.array_records:
        return content.array_records[keys.REC_CONTRIB]
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        return None
    local = next(iter(content.array_records.values()))
    metrics = next(iter(content.metric_records.values()))
    weight = metrics.get(weighted_by_key)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or set(local.keys()) != set(global_arrays)
    ):
        return None
    w = np.float32(weight)
    arrays: Arrays = {
        keys.PREFIX_DELTA + k: (
            (np.asarray(array_numpy(local[k]), np.float32) - global_arrays[k].astype(np.float32))
            * w
        )
        for k in global_arrays
    }
    arrays[keys.KEY_WEIGHT] = np.array([w], np.float32)
    arrays[keys.KEY_COUNT] = np.array([1.0], np.float32)
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def reply_contribution(
    content: RecordDict, global_arrays: Arrays, spec: ContributionSpec, weighted_by_key: str
) -> tuple[Arrays | None, str | None]:
    """Return (the reply's contribution as arrays, None) or (None, why it is refused)."""
    record = contribution_record(content, global_arrays, weighted_by_key)
    if record is None:
        return None, (
            f"reply has neither a '{keys.REC_CONTRIB}' ArrayRecord nor one ArrayRecord of the "
            f"model's arrays with a '{weighted_by_key}' metric; build replies with "
            "fedge.strategies.client.TrainRound"
        )
    arrays, problem = contribution_arrays(record, spec)
    if problem is not None:
        plain = keys.REC_CONTRIB not in content.array_records
        if plain and any(k.startswith(keys.PREFIX_CONTROL) for k in spec):
            problem += (
                " (a plain Flower reply carries no SCAFFOLD control delta: build the reply "
                "with fedge.strategies.client.TrainRound)"
            )
        return None, problem
    return arrays, None
