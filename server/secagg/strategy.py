"""SecAgg+ for any Flower ServerApp: a Flower ``Strategy`` that wraps a fedge strategy.

A plain ServerApp adds fedge's SecAgg+ by wrapping its strategy, and its ClientApp by
adding one mod (``ClientApp(mods=[fedge.clients.mods.dispatch_mods])``, which carries the
node's privacy policy and runs ``fedge.clients.secagg.mod.secaggplus_mod`` on every SecAgg+
stage)::

    strategy = SecAggPlus(Scaffold(min_train_nodes=4, min_available_nodes=4))
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=3)

The protocol is the one fedge's own round loop runs (:class:`SecAggPlusAggregator`, the
same object): keys advertised once per run, then per round a collect stage (the inner
strategy's train content, trained and masked by the client mod) and an unmask stage.
Flower's ``start`` sends a strategy's train messages in one exchange, and SecAgg+ needs
two or three, so ``configure_train`` samples (the inner strategy's own sampling and
content) and returns no messages, and ``aggregate_train`` runs the stages over the grid
it was given and hands the unmasked sum to the inner strategy's ``aggregate_sum``.
Evaluation passes through to the inner strategy.

Only the sum reaches the server, so a rule that needs each client's update (median,
trimmed mean, Krum, per-client bounds) cannot apply and is refused at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedge import keys
from fedge.secagg.config import SecAggConfig, weight_scales
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.strategies.base import Strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Pending:
    """One round's sampled nodes and train content, between configure and aggregate."""

    grid: Grid
    node_ids: list[int]
    content: RecordDict


class SecAggPlus(FlowerStrategy):
    """Run ``inner``'s training rounds under fedge's SecAgg+; the server sees only their sum.

    ``cfg`` defaults to SecAgg+'s defaults with the divisors ``inner``'s weighting needs
    (:func:`fedge.secagg.config.weight_scales`); ``timeout`` bounds the collect stage
    (training) in seconds, beside ``cfg.stage_timeout_s`` for the other stages.
    """

    def __init__(
        self, inner: Strategy, cfg: SecAggConfig | None = None, timeout: float | None = None
    ) -> None:
        if not isinstance(inner, Strategy):
            raise ValueError(
                f"SecAggPlus wraps a fedge strategy (strategies.fedavg/fedprox/scaffold), got "
                f"{type(inner).__name__}: Flower's own strategies read each client's reply, "
                "which SecAgg+ hides"
            )
        robust = inner.robust
        if robust.rule != "mean" or robust.max_weight > 0 or robust.max_update_norm > 0:
            raise ValueError(
                f"SecAggPlus: the inner strategy's robust={robust} needs each client's "
                "update (rule median/trimmed-mean/krum, max_weight, max_update_norm), and "
                "SecAgg+ shows the server only the sum; pass robust=None"
            )
        self.inner = inner
        self.aggregator = SecAggPlusAggregator(
            cfg if cfg is not None else SecAggConfig(key_scales=weight_scales(inner.weighting))
        )
        self.timeout = timeout
        self._pending: _Pending | None = None

    def summary(self) -> None:
        """Log the SecAgg+ settings, then the inner strategy's."""
        log.info("fedge SecAgg+ around %s: %s", type(self.inner).__name__, self.aggregator.cfg)
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample and build the train content with the inner strategy; send nothing yet."""
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._pending = (
            _Pending(grid, [m.metadata.dst_node_id for m in messages], messages[0].content)
            if messages
            else None
        )
        return []  # aggregate_train sends the content as SecAgg+'s collect stage

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Run the SecAgg+ stages on the sampled nodes; the unmasked sum -> the next arrays."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None, None
        state = self.inner.round_state
        assert state is not None  # the inner configure_train opened the round
        result = self.aggregator.aggregate(
            pending.grid,
            server_round,
            pending.node_ids,
            pending.content,
            self.inner.contribution_spec(state),
            self.timeout,
        )
        if result.summed is None:
            log.error(
                "round %d: no aggregate applied (%s)", server_round, self.aggregator.last_failure
            )
            return None, None
        arrays = self.inner.aggregate_sum(server_round, result.summed)
        return arrays, summed_metrics(result.summed_metrics, len(result.accepted))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's evaluation (replies carry only the clients' evaluation metrics)."""
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The inner strategy's aggregation of the evaluation replies."""
        return self.inner.aggregate_evaluate(server_round, replies)


def summed_metrics(sums: dict[str, float], contributors: int) -> MetricRecord | None:
    """The clients' metrics from their masked sum: ``num-examples`` in total (rounded: the sum
    is quantized), the rest as the plain mean over the contributors (SecAgg+ cannot weight by a
    count it never sees alone)."""
    if not sums or contributors <= 0:
        return None
    return MetricRecord(
        {
            k: round(v) if k == keys.MET_NUM_EXAMPLES else v / contributors
            for k, v in sorted(sums.items())
        }
    )
