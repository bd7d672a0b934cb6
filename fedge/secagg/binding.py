"""The digest that binds a SecAgg+ round's pair masks to the content every client was sent.

A server that sends the victim the real model and everyone else a model that makes no
update (learning rate 0, no steps) reads the victim's update off the sum. Each pair mask
seed is therefore derived over this digest of the train content (global model arrays and
config, everything in the message but the per-client protocol record): two clients that
were sent different content derive different pair seeds, their masks do not cancel, and
the sum is noise instead of one client's update.
"""

from __future__ import annotations

import hashlib

from flwr.app import ArrayRecord, RecordDict

from fedge.secagg.wire import SECAGG_RECORD


def content_digest(content: RecordDict) -> bytes:
    """SHA-256 over every record of ``content`` except the SecAgg+ record, in name order."""
    h = hashlib.sha256(b"fedge-secagg content v1")
    for name in sorted(content):
        if name == SECAGG_RECORD:
            continue
        record = content[name]
        h.update(f"\x00{type(record).__name__}:{name}\x00".encode())
        if isinstance(record, ArrayRecord):
            for key in sorted(record):
                arr = record[key]  # serialized bytes as sent: no copy, no decode
                h.update(f"{key}|{arr.dtype}|{tuple(arr.shape)}|{arr.stype}|".encode())
                h.update(arr.data)
        else:
            for key in sorted(record):
                h.update(f"{key}={record[key]!r}\x00".encode())  # type: ignore[index]
    return h.digest()
