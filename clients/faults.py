"""Fault injection for resilience tests and drills: a client mod that corrupts chosen replies.

Enable with ``client-mods = "fedge.clients.faults:fault_mod"`` and
``x-fault-partitions = "1:nan,2:missing"`` (partition:fault). Faults: ``nan`` (a NaN
in the first delta), ``missing`` (drops one key), ``dtype`` (float64 array),
``shape`` (one array flattened and truncated), ``error`` (the client raises), ``poison``
(a well-formed model-poisoning reply: the update x(-50) at weight x1e6, the attack of
issue 30 that ``bench/poisoning.py`` measures). The server must reject each malformed reply,
log the node id, and aggregate the rest; a poisoned one is for the default defence
(:func:`fedge.strategies.robust.adaptive_bounds`) or a robust rule to handle.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge import keys

FAULT_KEY = "x-fault-partitions"
FAULTS = ("nan", "missing", "dtype", "shape", "error", "poison")
POISON_UPDATE, POISON_WEIGHT = -50.0, 1e6  # the poisoned client's update and weight factors


def parse_faults(spec: str) -> dict[int, str]:
    """Parse "1:nan,2:missing" into {1: "nan", 2: "missing"}, naming a bad entry."""
    out: dict[int, str] = {}
    for item in (p.strip() for p in spec.split(",") if p.strip()):
        pid, sep, kind = item.partition(":")
        if not sep or not pid.strip().isdigit() or kind not in FAULTS:
            raise ValueError(
                f"{FAULT_KEY} entry {item!r} must be '<partition>:<{'|'.join(FAULTS)}>'"
            )
        out[int(pid)] = kind
    return out


def fault_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Corrupt this node's train reply if its partition is listed in ``x-fault-partitions``."""
    if msg.metadata.message_type != "train" or keys.REC_CONFIG not in msg.content.config_records:
        return call_next(msg, context)
    spec = str(msg.content.config_records[keys.REC_CONFIG].get(FAULT_KEY, ""))
    kind = parse_faults(spec).get(int(context.node_config.get(keys.NODE_PARTITION_ID, -1)))
    if kind == "error":
        raise RuntimeError("injected client failure (x-fault-partitions)")
    reply = call_next(msg, context)
    if kind is None or reply.has_error():
        return reply
    record = reply.content.array_records[keys.REC_CONTRIB]
    arrays = {k: v.numpy() for k, v in record.items()}
    first = next(k for k in arrays if k.startswith(keys.PREFIX_DELTA))
    if kind == "nan":
        arrays[first] = arrays[first].copy()
        arrays[first].flat[0] = np.nan
    elif kind == "missing":
        del arrays[first]
    elif kind == "dtype":
        arrays[first] = arrays[first].astype(np.float64)
    elif kind == "poison":  # update x(-50) at weight x1e6: delta = weight x update
        factor = np.float32(POISON_UPDATE * POISON_WEIGHT)
        arrays = {
            k: v * factor if k.startswith(keys.PREFIX_DELTA) else v for k, v in arrays.items()
        }
        arrays[keys.KEY_WEIGHT] = arrays[keys.KEY_WEIGHT] * np.float32(POISON_WEIGHT)
    elif kind == "shape":
        arrays[first] = arrays[first].reshape(-1)[:-1].copy()
    reply.content[keys.REC_CONTRIB] = ArrayRecord(
        {k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}
    )
    return reply
