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

Distributed DP is the same object with ``dp``: every client clips its update and adds its
share of the noise before masking, the server accounts one Gaussian release per round and
refuses a round that would pass ``max_epsilon`` before sending it, and each round's epsilon
is logged and returned in its train metrics (so in Flower's ``Result``)::

    strategy = SecAggPlus(Scaffold(), dp=DistributedDP(noise_multiplier=1.0, clip_norm=0.5))

A round whose unmasked sum breaks the per-client bounds (summed weight, count, update norm:
``SecAggPlusAggregator.check_bounds``) is not applied and logged with the bound that failed;
after ``max_rejected_rounds`` such rounds (default 3, run-config key ``max-rejected-rounds``
through :func:`rejected_rounds_limit`, as fedge's own loop reads it; 0: never) ``start``
raises :class:`RejectedRoundsExceeded` naming the last failed bound, instead of running to
its last round at the initial model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log as flower_log
from flwr.serverapp import Grid

from fedge import keys
from fedge.secagg.config import SecAggConfig, weight_scales
from fedge.server.aggregation import AggregateResult, rejected_rounds_message
from fedge.server.privacy.aggregators import DistributedDPAggregator
from fedge.server.privacy.release import DistributedDP, Metrics, ReleaseAccount
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.strategies.base import AggregationError, CheckedStart, Strategy, UniformWeighting
from fedge.strategies.flower_dp import refuse_flower_dp_wrapper

__all__ = [
    "DistributedDP",
    "RejectedRoundsExceeded",
    "SecAggPlus",
    "rejected_rounds_limit",
    "round_failure",
    "summed_metrics",
]

log = logging.getLogger(__name__)


class RejectedRoundsExceeded(AggregationError):
    """``max_rejected_rounds`` SecAgg+ sums broke the per-client bounds: the run stops."""


def rejected_rounds_limit(run_config: Mapping[str, object]) -> int:
    """``max-rejected-rounds`` of a Flower app's run config (default 3, as fedge's loop)."""
    raw = run_config.get(keys.CFG_MAX_REJECTED_ROUNDS, keys.DEFAULT_MAX_REJECTED_ROUNDS)
    return int(str(raw))


@dataclass(frozen=True)
class _Pending:
    """One round's sampled nodes and train content, between configure and aggregate."""

    grid: Grid
    node_ids: list[int]
    content: RecordDict


class SecAggPlus(CheckedStart):
    """Run ``inner``'s training rounds under fedge's SecAgg+; the server sees only their sum.

    ``cfg`` defaults to SecAgg+'s defaults with the divisors ``inner``'s weighting needs
    (:func:`fedge.secagg.config.weight_scales`); ``timeout`` bounds the collect stage
    (training) in seconds, beside ``cfg.stage_timeout_s`` for the other stages. ``dp`` adds
    distributed DP (:class:`DistributedDP`; weighting then uniform: a strategy with example
    weighting is wrapped in :class:`UniformWeighting`). A round that yields no sum logs its
    cause and keeps it in ``last_failure``; the model stays as it was. After
    ``max_rejected_rounds`` sums that broke the per-client bounds (0: never) the run stops
    with :class:`RejectedRoundsExceeded` naming the last bound that failed.
    """

    def __init__(
        self,
        inner: Strategy,
        cfg: SecAggConfig | None = None,
        timeout: float | None = None,
        *,
        dp: DistributedDP | None = None,
        max_rejected_rounds: int = keys.DEFAULT_MAX_REJECTED_ROUNDS,
    ) -> None:
        if max_rejected_rounds < 0:
            raise ValueError(f"max_rejected_rounds must be >= 0, got {max_rejected_rounds}")
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
        if dp is not None and inner.weighting != "uniform":
            log.info("SecAggPlus with DP: %s weighs every client 1 (uniform weighting)", inner.name)
            inner = UniformWeighting(inner)
        self.inner = inner
        self.aggregator = SecAggPlusAggregator(
            cfg if cfg is not None else SecAggConfig(key_scales=weight_scales(inner.weighting))
        )
        self.timeout = timeout
        self.dp = dp
        self._dp_aggregator = (
            DistributedDPAggregator(self.aggregator, dp.config()) if dp is not None else None
        )
        self.account = ReleaseAccount(dp.config(), dp.on_budget) if dp is not None else None
        self.last_failure: str | None = None
        self._pending: _Pending | None = None
        self._refused = False
        self._last_rejected: dict[int, str] = {}  # node -> why, in the latest round
        self.max_rejected_rounds = max_rejected_rounds
        self.rejected_rounds = 0  # sums that broke the bounds in this run

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far under ``dp`` (0.0 without it)."""
        return self.account.epsilon if self.account is not None else 0.0

    def summary(self) -> None:
        """Log the SecAgg+ settings, then the inner strategy's."""
        log.info("fedge SecAgg+ around %s: %s", type(self.inner).__name__, self.aggregator.cfg)
        if self.dp is not None:
            log.info("fedge distributed DP: %s", self.dp)
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample and build the train content with the inner strategy; send nothing yet (nothing
        at all when this round's DP release would pass the budget)."""
        refuse_flower_dp_wrapper(self)
        self._refused = self.account is not None and not self.account.admit(server_round)
        if self._refused:
            self._pending = None
            return []
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
        if self._refused and self.account is not None:
            return None, self.account.refused()
        if pending is None:
            return None, None
        state = self.inner.round_state
        assert state is not None  # the inner configure_train opened the round
        aggregator = self._dp_aggregator if self._dp_aggregator is not None else self.aggregator
        result = aggregator.aggregate(
            pending.grid,
            server_round,
            pending.node_ids,
            pending.content,
            self.inner.contribution_spec(state),
            self.timeout,
        )
        self.last_failure = None
        flower_log(  # Flower FedAvg's line: here a result is a contribution in the secure sum
            INFO,
            "aggregate_train: Received %s results and %s failures",
            len(result.accepted),
            len(pending.node_ids) - len(result.accepted),
        )
        self._last_rejected = dict(result.rejected)
        if result.summed is None:
            self.last_failure = round_failure(server_round, result)
            log.error("round %d: no aggregate applied: %s", server_round, self.last_failure)
            return None, None
        # The server unmasked a (noised) sum: that is a release, applied or not.
        released = self.account.record(server_round) if self.account is not None else {}
        if result.out_of_bounds is not None:
            self.last_failure = f"round {server_round}: sum rejected: {result.out_of_bounds}"
            log.error("round %d: no aggregate applied: %s", server_round, self.last_failure)
            self.rejected_rounds += 1
            limit = self.max_rejected_rounds
            if 0 < limit <= self.rejected_rounds:
                stop = rejected_rounds_message(self.rejected_rounds, limit, result.out_of_bounds)
                log.error("round %d: %s", server_round, stop)
                raise RejectedRoundsExceeded(stop)
            return None, MetricRecord(released) if released else None
        # the contributors' client state (SCAFFOLD's c_i) commits; drop-outs' does not
        arrays = self.inner.aggregate_sum(server_round, result.summed, result.accepted)
        metrics = summed_metrics(result.summed_metrics, len(result.accepted))
        if released:
            merged: Metrics = {**dict(metrics or {}), **released}
            metrics = MetricRecord(merged)
        return arrays, metrics

    def reset_run(self) -> None:
        """A new run: the inner strategy's round counts and the rejected sums start at 0."""
        self.inner.reset_run()
        self.rejected_rounds = 0

    def check_run(self) -> None:
        """The inner strategy's check, naming the last round's failure and rejected nodes."""
        self.inner.check_applied(self._last_rejected, self.last_failure)

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


def round_failure(server_round: int, result: AggregateResult) -> str:
    """Why a round produced no sum: the aggregator's reason, else the nodes' refusals."""
    if result.failure:
        return result.failure
    reasons = "; ".join(f"node {n}: {why}" for n, why in sorted(result.rejected.items()))
    return f"round {server_round}: no sum ({reasons or 'no contributor'})"


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
