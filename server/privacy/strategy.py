"""Central DP for any Flower ServerApp: a Flower ``Strategy`` that wraps a fedge strategy.

DP-FedAvg (McMahan et al. 2018, arXiv:1710.06963): every client's update (the adapter or
model delta and, under SCAFFOLD, the control delta, jointly) is clipped to L2 norm C on the
server, the clipped updates are summed with weight 1 each, and the sum gets Gaussian noise of
std z C before the inner strategy's ``aggregate_sum`` turns it into the next model::

    strategy = CentralDP(Scaffold(min_train_nodes=10), noise_multiplier=1.0, clip=0.5,
                         max_epsilon=8.0)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=20)
    result.train_metrics_clientapp[20]["dp-epsilon"]   # epsilon after round 20

``clip`` is a fixed norm or :class:`AdaptiveClip` (Andrew et al. 2021, arXiv:1905.03871: C
follows a quantile of the update norms, estimated from a noised count that the accounting
covers). Evaluation passes through to the inner strategy. The server sees every clipped
update, so use it when the server is trusted; otherwise run distributed DP under SecAgg+
(``SecAggPlus(strategy, dp=DistributedDP(...))``). Clients need no mod: any ClientApp that
replies with ``fedge.strategies.client.TrainRound`` (or in Flower's quickstart shape) works.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.privacy.accounting import Method
from fedge.privacy.mechanism import add_gaussian_noise, clip_contribution
from fedge.privacy.randomness import secure_normal
from fedge.server.privacy.config import DPConfig
from fedge.server.privacy.release import (
    MET_UNCLIPPED,
    Metrics,
    OnBudget,
    ReleaseAccount,
    finite_positive,
)
from fedge.strategies.base import CheckedStart, Strategy, UniformWeighting
from fedge.strategies.contract import sum_contributions
from fedge.strategies.flower_dp import refuse_flower_dp_wrapper
from fedge.types import Arrays

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping (Andrew et al. 2021, arXiv:1905.03871, geometric update).

    C starts at ``initial_norm``; after each round C <- C exp(-lr (b - target_quantile)), with
    b the fraction of updates whose norm was at most C, counted with N(0, count_stddev^2)
    noise. The count is a second Gaussian release, so the updates' own noise multiplier drops
    to (z^-2 - (2 count_stddev)^-2)^(-1/2) and the pair costs exactly one release of z (the
    paper's Theorem 1); that needs 2 count_stddev > z. ``count_stddev`` None: m / 20 for m
    sampled clients (the paper's choice: b then carries noise of std 0.05), which needs m > 10 z.
    """

    initial_norm: float = 0.1
    target_quantile: float = 0.5  # the norm quantile C tracks: 0.5 = the median update
    lr: float = 0.2  # the paper's eta_C
    count_stddev: float | None = None

    def __post_init__(self) -> None:
        """Reject settings the update rule cannot use, naming the field."""
        finite_positive("AdaptiveClip.initial_norm", self.initial_norm)
        finite_positive("AdaptiveClip.lr", self.lr)
        if not 0 <= self.target_quantile <= 1:
            raise ValueError(f"AdaptiveClip.target_quantile={self.target_quantile}: use [0, 1]")
        if self.count_stddev is not None:
            finite_positive("AdaptiveClip.count_stddev", self.count_stddev)


def update_noise_multiplier(z: float, count_stddev: float) -> float:
    """The updates' noise multiplier that, with a count noised by ``count_stddev``, costs one
    Gaussian release of multiplier ``z`` (Andrew et al. 2021, Theorem 1)."""
    if 2 * count_stddev <= z:
        raise ValueError(
            f"adaptive clipping: count_stddev {count_stddev:.4g} must exceed noise_multiplier / 2 "
            f"= {z / 2:.4g} (the count's release would spend the whole budget); set "
            "AdaptiveClip(count_stddev=...) larger, or sample more clients (default m / 20)"
        )
    return float((z**-2 - (2 * count_stddev) ** -2) ** -0.5)


def unit_weight(contribution: Arrays) -> Arrays | None:
    """The contribution with weight 1 (``delta/`` divided by the weight it carried): every client
    then counts once, whatever number of examples it claims. None: a count other than 0 or 1."""
    count = float(contribution[keys.KEY_COUNT][0])
    if count not in (0.0, 1.0):
        return None
    weight = float(contribution[keys.KEY_WEIGHT][0])
    scale = 1.0 / weight if weight > 0 and count == 1.0 else 0.0
    out = {
        k: (np.asarray(v, np.float64) * scale).astype(np.float32)
        if k.startswith(keys.PREFIX_DELTA)
        else v
        for k, v in contribution.items()
    }
    out[keys.KEY_WEIGHT] = np.array([count], np.float32)
    return out


def _unit_or_why(contribution: Arrays) -> tuple[Arrays | None, str | None]:
    """(:func:`unit_weight` of the contribution, None), or (None, why it is refused)."""
    unit = unit_weight(contribution)
    return unit, (None if unit is not None else "meta/count must be 0 or 1")


class CentralDP(CheckedStart):
    """Train ``strategy`` with central DP: clip each update to C, noise the sum with std z C.

    Weighting is uniform (a client's weight, and so its influence, must be bounded): a
    strategy with example weighting is wrapped in :class:`UniformWeighting`, and every reply
    counts once whatever ``num-examples`` it reports. ``noise_multiplier`` is z; ``clip`` C, a
    number or :class:`AdaptiveClip`; epsilon is computed at ``target_delta`` by ``accountant``
    (``rdp``, or the tighter ``pld``), one Gaussian release per round (no amplification by
    sampling claimed: Flower's sampling is not secret), logged each round and added to the
    round's train metrics (``dp-epsilon``, ``dp-delta``, ``dp-noise-multiplier``,
    ``dp-clip-norm``). ``max_epsilon`` > 0 refuses a round BEFORE its messages leave when its
    release would pass it: ``on_budget="stop"`` sends nothing from then on (the round's metrics
    say ``dp-budget-exhausted``; the Result keeps the last model), ``"raise"`` raises Flower's
    ``PrivacyBudgetExhausted``. The clients' train metrics pass through un-noised, as in
    Flower's DP wrappers: they are not part of the accounted release.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        noise_multiplier: float,
        clip: float | AdaptiveClip = 1.0,
        target_delta: float = 1e-5,
        max_epsilon: float = 0.0,
        accountant: Method = "rdp",
        on_budget: OnBudget = "stop",
    ) -> None:
        if not isinstance(strategy, Strategy):
            raise ValueError(
                f"CentralDP wraps a fedge strategy (FedAvg, FedProx, Scaffold), got "
                f"{type(strategy).__name__}; for Flower's own strategies use Flower's "
                "DifferentialPrivacyServerSideFixedClipping"
            )
        robust = strategy.robust
        if robust.rule != "mean" or robust.max_weight > 0 or robust.max_update_norm > 0:
            raise ValueError(
                f"CentralDP: robust={robust}: the noise is calibrated to a sum of clipped "
                "updates; a median, trimmed mean, Krum or per-client bound changes what one "
                "client can move, so it is refused (pass robust=None; the clip bounds each "
                "client's update)"
            )
        self.adaptive = clip if isinstance(clip, AdaptiveClip) else None
        self.clip_norm = (
            self.adaptive.initial_norm
            if self.adaptive is not None
            else finite_positive("clip", float(clip))  # type: ignore[arg-type]
        )
        cfg = DPConfig(
            mode="central",
            clip_norm=self.clip_norm,
            noise_multiplier=noise_multiplier,
            target_delta=target_delta,
            max_epsilon=max_epsilon,
            accountant=accountant,
        )
        self.account = ReleaseAccount(cfg, on_budget)
        if strategy.weighting != "uniform":
            log.info("CentralDP: %s weighs every client 1 (uniform weighting)", strategy.name)
            strategy = UniformWeighting(strategy)
        self.inner = strategy
        self._sampled = 0
        self._refused = False

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far."""
        return self.account.epsilon

    def summary(self) -> None:
        """Log the DP settings, then the inner strategy's."""
        cfg = self.account.cfg
        log.info(
            "fedge central DP around %s: z %g, clip %s, delta %g, max_epsilon %g (%s)",
            self.inner.name,
            cfg.noise_multiplier,
            self.adaptive or self.clip_norm,
            cfg.target_delta,
            cfg.max_epsilon,
            cfg.accountant,
        )
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's messages, unless this round's release would pass the budget."""
        refuse_flower_dp_wrapper(self)
        self._refused = not self.account.admit(server_round)
        if self._refused:
            return []
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._sampled = len(messages)
        if self.adaptive is not None and messages:
            update_noise_multiplier(self.account.cfg.noise_multiplier, self._count_stddev())
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip every reply's update to C, sum, noise, then the inner strategy's ``aggregate_sum``."""
        if self._refused:
            return None, self.account.refused()
        if self.inner.round_state is None:
            return None, None
        clipped: list[Arrays] = []
        contents: list[RecordDict] = []
        nodes: list[int] = []
        unclipped = 0
        for node, unit, content in self.inner.accept_replies(server_round, replies, _unit_or_why):
            bounded, norm = clip_contribution(unit, self.clip_norm)
            if not math.isfinite(norm):
                log.warning("round %d: rejected node %d: non-finite update", server_round, node)
                continue
            unclipped += int(norm <= self.clip_norm)
            clipped.append(bounded)
            contents.append(content)
            nodes.append(node)
        if not clipped:
            log.error("round %d: no reply was accepted; nothing is released", server_round)
            return None, None
        clip_used = self.clip_norm
        z = self.account.cfg.noise_multiplier
        metrics: Metrics = {}
        if self.adaptive is not None:
            z = update_noise_multiplier(z, self._count_stddev())
            noisy = (unclipped + float(secure_normal((), self._count_stddev()))) / len(clipped)
            self.clip_norm *= math.exp(-self.adaptive.lr * (noisy - self.adaptive.target_quantile))
            metrics[MET_UNCLIPPED] = noisy
        noised = add_gaussian_noise(sum_contributions(clipped), z * clip_used)
        metrics.update(self.account.record(server_round, clip_used))
        # the clients in the sum commit their state (SCAFFOLD's c_i: exact up to the noise and
        # the clipping of its control delta, which the client does not see)
        arrays_out = self.inner.aggregate_sum(server_round, noised, nodes)
        return arrays_out, MetricRecord({**self._client_metrics(contents), **metrics})

    def reset_run(self) -> None:
        """A new run: the inner strategy's round counts start at 0, no refusal is held."""
        self.inner.reset_run()

    def check_run(self) -> None:
        """The inner strategy's check, naming the last round's refusals (it read the replies)."""
        self.inner.check_applied()

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's evaluation; none once the budget stopped training."""
        if self.account.exhausted_at is not None:
            return []
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The inner strategy's aggregation of the evaluation replies."""
        return self.inner.aggregate_evaluate(server_round, replies)

    def _count_stddev(self) -> float:
        assert self.adaptive is not None
        if self.adaptive.count_stddev is not None:
            return self.adaptive.count_stddev
        return max(self._sampled, 1) / 20.0

    def _client_metrics(self, contents: list[RecordDict]) -> Metrics:
        """Flower's aggregation of the clients' train metrics (those reporting the weight key)."""
        key = self.inner.weighted_by_key
        usable = [
            c
            for c in contents
            if len(c.metric_records) == 1 and key in next(iter(c.metric_records.values()))
        ]
        record = self.inner.train_metrics_aggr_fn(usable, key) if usable else None
        return dict(record or {})


__all__ = ["AdaptiveClip", "CentralDP", "update_noise_multiplier"]
