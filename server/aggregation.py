"""Aggregators: how one round's train messages go out and their contributions come back summed.

The round loop (:mod:`fedge.server.loop`) hands an aggregator the sampled node ids and the
train message content; the aggregator returns the element-wise SUM of the valid
contributions (see :mod:`fedge.strategies.base`). :class:`PlainAggregator` sends one train
message per node and sums in the clear; seeing each contribution, it also enforces the
per-client bounds (``max-client-weight``, ``max-update-norm``), the default defence
(:func:`fedge.strategies.robust.adaptive_bounds`: weights capped and outlying update norms
refused relative to the round's medians) and, with ``aggregator``
``median``, ``trimmed-mean`` or ``krum``, combines them robustly
(:mod:`fedge.strategies.robust`; the result keeps the shape of a sum). Privacy variants plug
in by name through the ``aggregator`` config key, as a dotted ``"package.module:factory"``
whose factory takes the resolved :class:`fedge.server.config.RunConfig` and returns an
object with the :class:`Aggregator` protocol, e.g. a SecAgg+ aggregator that runs
its own message stages and returns only the unmasked sum, or a central-DP wrapper
that clips each contribution and noises the sum of an inner aggregator.

Every aggregator must reject, not crash on, a malformed reply: use
:func:`validate_contribution` and report the node id with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.plugins import load_dotted
from fedge.server.grid import exchange_messages
from fedge.strategies.base import Arrays
from fedge.strategies.registry import ROBUST_AGGREGATORS, robust_config
from fedge.strategies.replies import contribution_problem
from fedge.strategies.robust import RobustConfig, adaptive_bounds, apply_bounds, robust_sum

if TYPE_CHECKING:
    from fedge.server.config import RunConfig

log = logging.getLogger(__name__)

ContributionSpec = dict[str, tuple[int, ...]]


@dataclass
class AggregateResult:
    """The outcome of one round's aggregation.

    ``summed`` is None when fewer valid contributions than needed came back;
    ``rejected`` maps node id to the reason its reply was refused; ``metrics`` holds
    each accepted node's MetricRecord as plain floats.
    """

    summed: Arrays | None
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    summed_metrics: dict[str, float] = field(default_factory=dict)  # SecAgg+: only their sums
    out_of_bounds: str | None = None  # SecAgg+: why the sum breaks the per-client bounds
    failure: str | None = None  # why no sum came back (SecAgg+: the protocol's reason)
    committed: list[int] | None = None  # nodes whose client state commits (None: ``accepted``)
    bytes_up: int = 0
    bytes_down: int = 0


class Aggregator(Protocol):
    """Sends one round's train messages and returns the sum of the valid contributions."""

    def aggregate(
        self,
        grid: Grid,
        server_round: int,
        node_ids: Sequence[int],
        content: RecordDict,
        spec: ContributionSpec,
        timeout: float | None,
    ) -> AggregateResult:
        """Run the round's training on ``node_ids`` and sum what they contribute.

        ``content`` is the train message every node receives (global adapter,
        strategy record, config); ``spec`` lists the keys and shapes of a valid
        contribution; ``timeout`` bounds the wait for replies in seconds.
        """
        ...


def rejected_rounds_message(rejected: int, limit: int, last: str) -> str:
    """Why a run stops after ``max-rejected-rounds`` SecAgg+ sums broke the per-client bounds
    (fedge's round loop and the Flower-app ``SecAggPlus`` say the same), naming the last bound."""
    return (
        f"stopped: {rejected} rounds' SecAgg+ sums broke the per-client bounds "
        f"(max-rejected-rounds={limit}); the last: {last}. A client sends more "
        "than the bounds allow (a poisoned or misconfigured client, or max-update-norm / "
        "max-client-weight set below honest clients' values); the global model is the last "
        "accepted one"
    )


def validate_contribution(record: ArrayRecord | None, spec: ContributionSpec) -> str | None:
    """Return why a contribution record is unacceptable (None when it is fine).

    Checks, in order: presence, the exact key set, float32 dtype, shape, finiteness.
    """
    return contribution_problem(record, spec)


def reply_metrics(msg: Message) -> dict[str, float]:
    """Return the reply's MetricRecord as plain floats (empty when absent)."""
    if keys.REC_METRICS not in msg.content.metric_records:
        return {}
    rec: MetricRecord = msg.content.metric_records[keys.REC_METRICS]
    return {k: float(v) for k, v in rec.items() if isinstance(v, int | float)}


def reply_node(reply: Message, sent: Mapping[str, int]) -> int:
    """The node a reply speaks for. The SuperLink itself writes the error reply for a node that
    is gone (its source is the SuperLink), so map a reply back through the message it answers;
    ``sent`` maps the ids of the pushed messages (set by the Grid on push) to their nodes."""
    return sent.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)


def record_dict_bytes(content: RecordDict) -> int:
    """Return the payload size of a RecordDict's arrays in bytes (what dominates the wire)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())


class PlainAggregator:
    """Sum contributions in the clear: the server sees each client's contribution.

    ``robust`` sets the per-client bounds and the combination rule (default: the exact sum);
    ``combine``, when set (the round loop sets the strategy's ``combine``), applies the rule
    instead and names the contributions whose client state commits (SCAFFOLD + Krum: the one
    Krum selects).
    """

    def __init__(
        self,
        robust: RobustConfig | None = None,
        combine: Callable[[list[Arrays]], tuple[Arrays, list[int]]] | None = None,
    ) -> None:
        self.robust = robust or RobustConfig()
        self.combine = combine

    def aggregate(
        self,
        grid: Grid,
        server_round: int,
        node_ids: Sequence[int],
        content: RecordDict,
        spec: ContributionSpec,
        timeout: float | None,
    ) -> AggregateResult:
        """Send one train message per node, validate every reply, sum the valid ones."""
        messages = [
            Message(
                content, dst_node_id=nid, message_type=MessageType.TRAIN, group_id=str(server_round)
            )
            for nid in node_ids
        ]
        replies = exchange_messages(grid, messages, timeout)
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
        result = AggregateResult(summed=None, bytes_down=record_dict_bytes(content) * len(messages))
        valid: list[tuple[float, int, Arrays]] = []
        for msg in replies:
            nid = reply_node(msg, sent)
            reason = _reply_problem(msg, spec)
            if reason is not None:
                result.rejected[nid] = reason
                log.warning("round %d: rejected reply from node %d: %s", server_round, nid, reason)
                continue
            rec = msg.content.array_records[keys.REC_CONTRIB]
            result.bytes_up += rec.count_bytes()
            contribution, reason = apply_bounds({k: rec[k].numpy() for k in spec}, self.robust)
            if reason is not None:
                result.rejected[nid] = reason
                log.warning("round %d: rejected reply from node %d: %s", server_round, nid, reason)
                continue
            result.metrics[nid] = reply_metrics(msg)
            order = result.metrics[nid].get(keys.MET_PARTITION, float(nid))
            valid.append((order, nid, contribution))
        for nid in set(node_ids) - {reply_node(m, sent) for m in replies}:
            result.rejected[nid] = "no reply before the round timeout"
            log.warning("round %d: node %d did not reply in time", server_round, nid)
        # Sum in partition order so a resumed run adds floats in the same order.
        valid.sort(key=lambda t: (t[0], t[1]))
        kept, refused = adaptive_bounds([c for _, _, c in valid], self.robust)
        for index, reason in sorted(refused.items()):
            nid = valid[index][1]
            result.rejected[nid] = reason
            result.metrics.pop(nid, None)
            log.warning("round %d: rejected reply from node %d: %s", server_round, nid, reason)
        valid = [
            (order, nid, c)
            for (order, nid, _), c in zip(
                [v for i, v in enumerate(valid) if i not in refused], kept, strict=True
            )
        ]
        result.accepted = [nid for _, nid, _ in valid]
        if valid and self.combine is not None:
            result.summed, chosen = self.combine([c for _, _, c in valid])
            result.committed = [valid[i][1] for i in chosen]
        elif valid:
            result.summed = robust_sum([c for _, _, c in valid], self.robust)
        return result


def _reply_problem(msg: Message, spec: ContributionSpec) -> str | None:
    """Return why a reply message is unusable: an error reply, or a bad contribution."""
    if msg.has_error():
        return f"client error {msg.error.code}: {msg.error.reason}"
    record = msg.content.array_records.get(keys.REC_CONTRIB)
    return validate_contribution(record, spec)


AggregatorFactory = Callable[["RunConfig"], Aggregator]


def build_aggregator(name: str, config: RunConfig) -> Aggregator:
    """Return the aggregator named by the ``aggregator`` config key.

    ``"plain"`` and the robust rules (``median``, ``trimmed-mean``, ``krum``) are built in;
    anything else must be ``"package.module:factory"``.
    """
    if name == "plain" or name in ROBUST_AGGREGATORS:
        return PlainAggregator(robust_config(config.to_mapping()))
    factory = load_dotted(name, what="aggregator")
    return factory(config)  # type: ignore[return-value]
