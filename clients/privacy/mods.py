"""Distributed DP on the client: clip the contribution and add this client's share of the noise."""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import Array, ArrayRecord, Context, Error, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable

from fedge import keys
from fedge.clients.privacy.ledger import node_ledger
from fedge.clients.privacy.policy import PolicyRefusal, requested_dp
from fedge.privacy.ffa import ffa_enabled, frozen_keys, zero_frozen
from fedge.privacy.mechanism import (
    add_gaussian_noise,
    clip_contribution,
    loss_release_settings,
    noised_loss,
)
from fedge.privacy.wire import KEY_DP_CLIP, KEY_DP_NOISE_STD, MET_DP_TRAIN_LOSS
from fedge.secagg.wire import SECAGG_RECORD

# Error code of a refused distributed-DP message (Flower reserves the small codes).
ERROR_DP = 641


def distributed_dp_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Clip the train reply's sensitive contribution to C and add N(0, std^2) before it leaves.

    C and std come from the ``config`` record (``dp-clip-norm``, ``dp-noise-std``) that
    ``fedge.server.privacy.aggregators.DistributedDPAggregator`` adds. Listed after the SecAgg+ mod
    in ``client-mods``, it runs before masking, so the server never sees an un-noised update.
    The noise is drawn from the OS CSPRNG, never from a seed the server could know; the
    release is recorded in this node's privacy ledger (``fedge.clients.privacy.ledger``).

    The training loss, when the reply carries one, is released the same way (never in clear):
    clipped into [0, L] (``dp-metric-clip``, default 12; 0 keeps it home) with noise std
    ``k std L / C`` (``dp-metric-noise-scale`` k, default 3), so its multiplier is k z, as
    ``dp-train-loss``; the SecAgg+ mod sums it inside the masked vector and the ledger
    records it as a second release, at k z.
    """
    if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return call_next(msg, context)
    config = msg.content.config_records.get(keys.REC_CONFIG) if msg.has_content() else None
    if config is None or KEY_DP_CLIP not in config or KEY_DP_NOISE_STD not in config:
        return Message(
            Error(
                code=ERROR_DP,
                reason=f"distributed_dp_mod: the train config lacks '{KEY_DP_CLIP}' and "
                f"'{KEY_DP_NOISE_STD}'; run the server with DistributedDPAggregator",
            ),
            reply_to=msg,
        )
    try:
        dp = requested_dp(config, msg.content.config_records.get(SECAGG_RECORD))
    except PolicyRefusal as exc:
        return Message(Error(code=ERROR_DP, reason=f"distributed_dp_mod: {exc}"), reply_to=msg)
    clip, std = float(str(config[KEY_DP_CLIP])), float(str(config[KEY_DP_NOISE_STD]))
    reply = call_next(msg, context)
    if reply.has_error() or keys.REC_CONTRIB not in reply.content.array_records:
        return reply
    record = reply.content.array_records[keys.REC_CONTRIB]
    arrays = {k: a.numpy() for k, a in record.items()}
    skip: frozenset[str] = frozenset()
    if ffa_enabled(config):  # FFA-LoRA: lora_A deltas are public zeros, no noise
        arrays, skip = zero_frozen(arrays), frozenset(frozen_keys(arrays))
    clipped, _ = clip_contribution(arrays, clip)
    noised = add_gaussian_noise(clipped, std, skip)
    reply.content[keys.REC_CONTRIB] = ArrayRecord({k: Array(v) for k, v in noised.items()})
    loss_scale = release_loss(reply, config, clip, std)
    if (
        dp is not None and dp.noise_multiplier > 0
    ):  # this node released a noised update (and loss): its own ledger counts each
        ledger = node_ledger(context)
        ledger.record_release(dp.noise_multiplier)
        if loss_scale > 0:
            ledger.record_release(loss_scale * dp.noise_multiplier)
    return reply


def release_loss(reply: Message, config: Mapping[str, object], clip: float, std: float) -> float:
    """Replace the reply's ``train-loss`` by its Gaussian release ``dp-train-loss`` (std k std
    L / C: multiplier k z); return k, or 0 when nothing was released (no loss in the reply,
    or ``dp-metric-clip = 0``: the loss then stays home and nothing is spent)."""
    metrics = reply.content.metric_records.get(keys.REC_METRICS)
    if metrics is None or keys.MET_TRAIN_LOSS not in metrics:
        return 0.0
    bound, scale = loss_release_settings(config)
    kept = {k: v for k, v in metrics.items() if k != keys.MET_TRAIN_LOSS}
    if bound > 0:
        loss = float(metrics[keys.MET_TRAIN_LOSS])  # type: ignore[arg-type]
        kept[MET_DP_TRAIN_LOSS] = noised_loss(loss, bound, scale * std * bound / clip)
    reply.content[keys.REC_METRICS] = MetricRecord(kept)
    return scale if bound > 0 else 0.0
