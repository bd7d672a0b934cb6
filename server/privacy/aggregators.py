"""Central and distributed DP as wrappers around a round-loop aggregator."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.privacy.ffa import ffa_enabled, frozen_keys, zero_frozen
from fedge.privacy.mechanism import add_gaussian_noise, clip_contribution
from fedge.privacy.wire import (
    DDP_CLIENT_MOD,
    KEY_DP_ACTIVE,
    KEY_DP_CLIP,
    KEY_DP_MIN_CLIENTS,
    KEY_DP_NOISE_STD,
)
from fedge.server.aggregation import AggregateResult, Aggregator, ContributionSpec
from fedge.server.grid import ReplyHookGrid
from fedge.server.privacy.config import DPConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator

log = logging.getLogger(__name__)


class CentralDPAggregator:
    """Clip every contribution to C as it arrives, let ``inner`` sum, add N(0, (z C)^2) to the sum.

    The server sees individual (clipped) contributions: use it with the plain aggregator.
    Pair it with ``fedge.strategies.base.UniformWeighting`` so a client's weight is 1 and the
    clipped contribution bounds its influence; the budget is ``fedge.server.privacy.accountant.DPBudget``.
    """

    def __init__(self, inner: Aggregator, cfg: DPConfig) -> None:
        if cfg.mode != "central":
            raise ValueError(
                f"CentralDPAggregator needs DPConfig(mode='central'), got {cfg.mode!r}"
            )
        self.inner = inner
        self.cfg = cfg
        self.last_norms: dict[int, float] = {}

    def aggregate(
        self,
        grid: Grid,
        server_round: int,
        node_ids: Sequence[int],
        content: RecordDict,
        spec: ContributionSpec,
        timeout: float | None,
    ) -> AggregateResult:
        """Run ``inner`` over a grid that clips each reply, then noise the sensitive sum."""
        content = with_config(content, {KEY_DP_ACTIVE: True}, None)
        ffa = ffa_enabled(content.config_records[keys.REC_CONFIG])
        clipping = ClippingGrid(grid, self.cfg.clip_norm, ffa)
        result = self.inner.aggregate(clipping, server_round, node_ids, content, spec, timeout)
        self.last_norms = dict(clipping.norms)
        if result.summed is not None:
            std = self.cfg.noise_multiplier * self.cfg.clip_norm
            skip = frozenset(frozen_keys(spec)) if ffa else frozenset()
            result.summed = add_gaussian_noise(result.summed, std, skip)
        return result


class DistributedDPAggregator:
    """Ask every client to clip to C and add N(0, (z C)^2 / m) before SecAgg+ masks it.

    m = ``cfg.min_clients(n)`` of the n sampled clients; the SecAgg+ round fails unless at
    least m contributions survive, so every released sum carries noise of std >= z C and the
    server never sees an un-noised individual update. Needs ``UniformWeighting``.
    """

    def __init__(self, inner: SecAggPlusAggregator, cfg: DPConfig) -> None:
        if cfg.mode != "distributed":
            raise ValueError(
                f"DistributedDPAggregator needs DPConfig(mode='distributed'), got {cfg.mode!r}"
            )
        self.inner = inner
        self.cfg = cfg
        # The noise is inside the sum, so its norm says nothing about the updates: each one is
        # bounded by the clients' clip C instead; the summed weight and count are still checked.
        inner.bounds = replace(inner.bounds, max_update_norm=0.0)

    @property
    def last_failure(self) -> str | None:
        """Why the last round produced no sum (the SecAgg+ aggregator's reason), else None."""
        return self.inner.last_failure

    def aggregate(
        self,
        grid: Grid,
        server_round: int,
        node_ids: Sequence[int],
        content: RecordDict,
        spec: ContributionSpec,
        timeout: float | None,
    ) -> AggregateResult:
        """Add the clip norm and the per-client noise std to the train config, then run SecAgg+."""
        n = len(node_ids)
        extra: dict[str, float | int | str | bool] = {
            KEY_DP_ACTIVE: True,
            KEY_DP_CLIP: float(self.cfg.clip_norm),
            KEY_DP_NOISE_STD: float(self.cfg.client_noise_std(n)),
            KEY_DP_MIN_CLIENTS: self.cfg.min_clients(n),
        }
        self.inner.min_contributors = self.cfg.min_clients(n)
        return self.inner.aggregate(
            grid, server_round, node_ids, with_config(content, extra, DDP_CLIENT_MOD), spec, timeout
        )


def with_config(
    content: RecordDict, extra: dict[str, float | int | str | bool], mod: str | None
) -> RecordDict:
    """Copy ``content`` with keys added to its ``config`` record and ``mod`` in ``client-mods``.

    ``mod`` is placed innermost, after any SecAgg+ mod, so it edits the contribution first.
    """
    out = RecordDict()
    for name, record in content.items():
        out[name] = record
    config = ConfigRecord(dict(content.config_records.get(keys.REC_CONFIG, ConfigRecord())))
    mods = [m.strip() for m in str(config.get(keys.CFG_CLIENT_MODS, "")).split(",") if m.strip()]
    if mod is not None and mod not in mods:
        mods.append(mod)
    config[keys.CFG_CLIENT_MODS] = ",".join(mods)
    for k, v in extra.items():
        config[k] = v
    out[keys.REC_CONFIG] = config
    return out


class ClippingGrid(ReplyHookGrid):
    """A Grid that clips the contribution of every reply it hands back (central DP).

    All other calls go to the wrapped grid unchanged; ``norms`` records each reply's
    sensitive L2 norm before clipping.
    """

    def __init__(self, grid: Grid, clip_norm: float, ffa: bool = False) -> None:
        super().__init__(grid)
        self.clip_norm = clip_norm
        self.ffa = ffa  # zero FFA-LoRA's frozen lora_A keys before clipping
        self.norms: dict[int, float] = {}

    def on_reply(self, msg: Message) -> Message:
        """Clip the reply's contribution."""
        return self._clip(msg)

    def _clip(self, msg: Message) -> Message:
        if msg.has_error():
            return msg
        record = msg.content.array_records.get(keys.REC_CONTRIB)
        if record is None:
            return msg
        arrays = {k: a.numpy() for k, a in record.items()}
        if not all(a.dtype == np.float32 and np.isfinite(a).all() for a in arrays.values()):
            return msg  # the inner aggregator rejects it, naming the problem
        clipped, norm = clip_contribution(
            zero_frozen(arrays) if self.ffa else arrays, self.clip_norm
        )
        self.norms[msg.metadata.src_node_id] = norm
        msg.content[keys.REC_CONTRIB] = ArrayRecord({k: Array(v) for k, v in clipped.items()})
        if not math.isfinite(norm):
            log.warning("node %d sent a contribution of non-finite norm", msg.metadata.src_node_id)
        return msg
