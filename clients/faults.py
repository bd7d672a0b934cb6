"""Fault injection for resilience tests and drills: a client mod that corrupts chosen replies.

Enable with ``client-mods = "fedge.clients.faults:fault_mod"`` and
``x-fault-partitions = "1:nan,2:missing"`` (partition:fault). Faults: ``nan`` (a NaN
in the first delta), ``missing`` (drops one key), ``dtype`` (float64 array),
``shape`` (one array flattened and truncated), ``error`` (the client raises).
The server must reject each such reply, log the node id, and aggregate the rest.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge import keys

FAULT_KEY = "x-fault-partitions"
FAULTS = ("nan", "missing", "dtype", "shape", "error")


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
    elif kind == "shape":
        arrays[first] = arrays[first].reshape(-1)[:-1].copy()
    reply.content[keys.REC_CONTRIB] = ArrayRecord(
        {k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}
    )
    return reply
