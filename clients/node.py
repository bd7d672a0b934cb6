"""What a message and this node say about one call: the config record, its names resolved, the partition.

Light on purpose (Flower and fedge's names only): a node answering a ``query`` needs these and
nothing of the training stack (:mod:`fedge.clients.app`).
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedge import keys, names
from fedge.types import ConfigValue


def message_config(msg: Message) -> dict[str, ConfigValue]:
    """Return the message's ``config`` record as a plain dict, or raise naming the missing record."""
    if keys.REC_CONFIG not in msg.content.config_records:
        raise ValueError(
            f"message has no '{keys.REC_CONFIG}' ConfigRecord; send it from fedge's ServerApp"
        )
    return dict(msg.content.config_records[keys.REC_CONFIG])  # type: ignore[arg-type]


def local_config(msg: Message, context: Context) -> dict[str, ConfigValue]:
    """The message config with its data and model names resolved under this node's roots
    (:mod:`fedge.names`): the server names identifiers, never paths on this client."""
    return names.resolve_config(message_config(msg), context.node_config)


def partition_id(context: Context) -> int:
    """Return this node's partition from its node config (``partition-id``), or say how to set it."""
    value = context.node_config.get(keys.NODE_PARTITION_ID)
    if value is None:
        raise ValueError(
            "node config has no 'partition-id'; start the SuperNode with "
            "--node-config 'partition-id=0 num-partitions=2'"
        )
    return int(value)
