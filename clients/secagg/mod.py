"""The SecAgg+ Flower client mod: answers protocol stages and masks the train contribution."""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from clients.secagg.engine import SecAggClientEngine, SecAggProtocolError
from fedge import keys
from fedge.secagg import wire
from fedge.secagg.vectors import scale_for

# Error code of a refused SecAgg+ message (Flower reserves the small codes).
ERROR_SECAGG = 640


def secaggplus_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Run the SecAgg+ stage a message carries; pass every other message through untouched.

    In the collect stage the mod trains through ``call_next``, then replaces the reply's
    ``contribution`` record by its masked form, so the plain contribution never leaves the
    client. A refused stage becomes an error reply naming the reason; the server counts that
    node as dropped. The server half is ``server.secagg.aggregator.SecAggPlusAggregator``.
    """
    if not msg.has_content() or wire.SECAGG_RECORD not in msg.content.config_records:
        return call_next(msg, context)
    states = context.state.config_records
    if wire.SECAGG_STATE_RECORD not in states:
        states[wire.SECAGG_STATE_RECORD] = ConfigRecord()
    engine = SecAggClientEngine(msg.metadata.dst_node_id, states[wire.SECAGG_STATE_RECORD])
    passthrough = RecordDict()

    def contribute() -> dict[str, np.ndarray]:
        reply = call_next(msg, context)
        if reply.has_error():
            raise SecAggProtocolError(f"local training failed: {reply.error.reason}")
        record = reply.content.array_records.get(keys.REC_CONTRIB)
        if record is None:
            raise SecAggProtocolError(f"the train reply has no {keys.REC_CONTRIB!r} record to mask")
        for name, rec in reply.content.items():
            if name != keys.REC_CONTRIB:
                passthrough[name] = rec
        arrays = {k: a.numpy() for k, a in record.items()}
        _check_range(arrays, engine)
        return arrays

    try:
        out = engine.handle(msg.content, contribute)
    except (SecAggProtocolError, ValueError) as exc:
        return Message(Error(code=ERROR_SECAGG, reason=f"SecAgg+: {exc}"), reply_to=msg)
    for name, rec in passthrough.items():
        out[name] = rec
    return Message(out, reply_to=msg)


def _check_range(arrays: dict[str, np.ndarray], engine: SecAggClientEngine) -> None:
    """Refuse values the quantizer would clip: a clipped sum would be silently wrong."""
    state = engine.state
    clip = wire.get_number(state, wire.KEY_CLIPPING_RANGE)
    scales = wire.get_scales(state)
    for name, arr in arrays.items():
        peak = float(np.max(np.abs(arr))) / scale_for(name, scales) if arr.size else 0.0
        if not np.isfinite(peak) or peak > clip:
            raise SecAggProtocolError(
                f"contribution {name!r} reaches {peak:.3g} after scaling, outside the SecAgg+ "
                f"clipping range {clip}; raise secagg-clipping-range or the key's scale"
            )
