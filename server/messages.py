"""The messages the round loop sends: train, partition query and evaluate, and their replies.

Every message carries the run's client config (paths reduced to identifiers, :mod:`fedge.names`);
the train message adds the global adapter and the strategy's record. Replies that fail
are logged with their node id and left out, never fatal.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedge import keys, names
from fedge.lm import holder
from fedge.server.aggregation import reply_metrics
from fedge.server.config import RunConfig
from fedge.strategies.base import ConfigValue, GlobalState, Strategy

log = logging.getLogger(__name__)

NODE_WAIT_SECONDS = (
    300.0  # first nodes: a Ray engine starting on a busy 2-core machine took over 120 s
)


def client_config(cfg: RunConfig) -> dict[str, ConfigValue]:
    """The run's client config, naming data, models and state by identifiers, never by the
    server's paths (:func:`fedge.names.wire_names`): each client resolves them under its roots."""
    return names.wire_names(cfg.client_config())  # type: ignore[return-value]


def server_config(cfg: RunConfig) -> dict[str, ConfigValue]:
    """The client config with the server's own paths and resolved model dir, for the server's
    own copy of the corpus and model (never sent: messages carry :func:`client_config`)."""
    return {**cfg.client_config(), keys.CFG_MODEL_PATH: holder.resolve_model(cfg.model)}


def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """numpy arrays -> ArrayRecord (contiguous float32 copies are what clients expect)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def train_content(
    state: GlobalState,
    strategy: Strategy,
    cfg: RunConfig,
    server_round: int,
    target: int = 0,
    committed: Mapping[int, int] | None = None,
) -> RecordDict:
    """The train message: global adapter, strategy record, and the full client config.

    ``target`` (K, the reports the round wants) rides along for Grid wrappers that close a
    round at the first K reports (the simulated devices' grid); clients ignore it.
    ``committed`` (partition -> last accepted round) tells each sampled client which of
    its saved states the server's aggregate actually contains.
    """
    config: dict[str, Any] = {
        **client_config(cfg),
        **strategy.client_config(server_round),
        keys.CFG_SERVER_ROUND: server_round,
        keys.CFG_TARGET_REPORTS: target,
    }
    if committed is not None:
        parts = sorted(committed)
        config[keys.CFG_COMMITTED_PARTITIONS] = parts
        config[keys.CFG_COMMITTED_ROUNDS] = [committed[p] for p in parts]
    return RecordDict(
        {
            keys.REC_GLOBAL: to_array_record(state.adapter),
            keys.REC_STRATEGY: to_array_record(strategy.client_payload(state)),
            keys.REC_CONFIG: ConfigRecord(config),  # type: ignore[arg-type]
        }
    )


def query_partitions(grid: Grid, nodes: Sequence[int], cfg: RunConfig) -> dict[int, int]:
    """Ask every node for its partition id; nodes that do not answer are left out."""
    content = RecordDict({keys.REC_CONFIG: ConfigRecord(client_config(cfg))})  # type: ignore[arg-type]
    messages = [
        Message(content, dst_node_id=n, message_type=MessageType.QUERY, group_id="0") for n in nodes
    ]
    out: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=min(NODE_WAIT_SECONDS, cfg.round_timeout)):
        if reply.has_error():
            log.warning(
                "node %d failed the partition query: %s",
                reply.metadata.src_node_id,
                reply.error.reason,
            )
            continue
        metrics = reply_metrics(reply)
        if keys.MET_PARTITION in metrics:
            out[reply.metadata.src_node_id] = int(metrics[keys.MET_PARTITION])
    return out


def client_evaluate(
    grid: Grid, nodes: Sequence[int], state: GlobalState, cfg: RunConfig, server_round: int
) -> float:
    """Example-weighted mean of the clients' held-out losses (NaN when none answered)."""
    content = RecordDict(
        {
            keys.REC_GLOBAL: to_array_record(state.adapter),
            keys.REC_CONFIG: ConfigRecord(
                {**client_config(cfg), keys.CFG_SERVER_ROUND: server_round}
            ),  # type: ignore[arg-type]
        }
    )
    messages = [
        Message(
            content, dst_node_id=n, message_type=MessageType.EVALUATE, group_id=str(server_round)
        )
        for n in nodes
    ]
    total, weight = 0.0, 0.0
    for reply in grid.send_and_receive(messages, timeout=cfg.round_timeout):
        if reply.has_error():
            log.warning(
                "round %d: node %d failed to evaluate: %s",
                server_round,
                reply.metadata.src_node_id,
                reply.error.reason,
            )
            continue
        m = reply_metrics(reply)
        if math.isfinite(m.get(keys.MET_EVAL_LOSS, math.nan)):
            total += m[keys.MET_EVAL_LOSS] * m.get(keys.MET_NUM_EXAMPLES, 1.0)
            weight += m.get(keys.MET_NUM_EXAMPLES, 1.0)
    return total / weight if weight else math.nan
