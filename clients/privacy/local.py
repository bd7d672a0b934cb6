"""What the ClientApp's train handler calls for privacy: FFA-LoRA and a DP-SGD round.

Config keys (plug-in keys of ``RunConfig.extra``, sent with every message):

* ``dp-sgd-noise-multiplier``: > 0 turns sample-level DP-SGD on (0, the default, is off);
* ``dp-sgd-max-grad-norm`` (1.0), ``dp-sgd-delta`` (1e-5);
* ``dp-metric-clip`` (12.0): L of the noised training-loss release (0: the loss stays on
  the node and costs nothing; ``fedge.clients.privacy.dpsgd``), and
  ``dp-metric-noise-scale`` (3.0): k, the loss's noise multiplier is k z;
* ``dp-ffa-lora``: ``auto`` (default: on whenever DP-SGD or a DP aggregator is active),
  ``on`` or ``off``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import numpy as np
import torch

from fedge.clients.privacy.dpsgd import (
    DPSGDConfig,
    cumulative_epsilon,
    projected_epsilon,
    token_records,
    train_dpsgd,
)
from fedge.clients.privacy.ledger import DPSGD, Ledger
from fedge.errors import FedgeError
from fedge.privacy.ffa import KEY_FFA, ffa_enabled
from fedge.privacy.mechanism import loss_release_settings
from fedge.privacy.wire import (
    KEY_DPSGD_CLIP,
    KEY_DPSGD_DELTA,
    KEY_DPSGD_NOISE,
    MET_DP_TRAIN_LOSS,
    MET_DPSGD_EPSILON,
    REFUSAL_BUDGET,
)
from fedge.strategies.base import ClientHook, ConfigValue

__all__ = ["KEY_FFA", "apply_ffa", "dpsgd_config", "ffa_enabled", "train_dpsgd_round"]
ERROR_BUDGET = 643  # error code of a round refused for an exhausted budget
log = logging.getLogger(__name__)


def dpsgd_config(config: Mapping[str, ConfigValue]) -> DPSGDConfig | None:
    """The DP-SGD settings of a train message, or None when DP-SGD is off."""
    noise = float(config.get(KEY_DPSGD_NOISE, 0.0))
    if noise <= 0:
        return None
    clip, scale = loss_release_settings(config)
    return DPSGDConfig(
        noise_multiplier=noise,
        max_grad_norm=float(config.get(KEY_DPSGD_CLIP, 1.0)),
        target_delta=float(config.get(KEY_DPSGD_DELTA, 1e-5)),
        ffa_lora=ffa_enabled(config),
        metric_clip=clip,
        metric_noise_scale=scale,
    )


def apply_ffa(model: torch.nn.Module, enabled: bool) -> None:
    """Freeze (FFA-LoRA) or unfreeze every ``lora_A`` tensor of a cached model.

    With A fixed and shared, averaging the B factors averages the updates B A exactly.
    """
    for name, param in model.named_parameters():
        if "lora_A" in name:
            param.requires_grad_(not enabled)


class BudgetExhausted(FedgeError):
    """One more round would take this client's epsilon past its budget; it does not train."""


def train_dpsgd_round(
    model: torch.nn.Module,
    tokens: np.ndarray,
    *,
    dp: DPSGDConfig,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    hook: ClientHook,
    ledger: Ledger,
    max_epsilon: float = 0.0,
    bos: int | None = None,
) -> tuple[list[float], dict[str, float]]:
    """Run one round of DP-SGD; return the step losses (they stay on the node) and the
    metrics to report: the noised loss ``dp-train-loss`` (unless ``dp-metric-clip`` is 0)
    and ``dp-sgd-epsilon``, which counts that release.

    The accountant history lives in this node's ledger on disk, so the reported
    ``dp-sgd-epsilon`` is cumulative across rounds and restarts. With ``max_epsilon`` > 0
    the round is refused (:class:`BudgetExhausted`) before a step when it would pass it.
    """
    data = ledger.load()
    state: dict[str, object] = dict(data.get(DPSGD, {}))
    if max_epsilon > 0:
        records = len(token_records(tokens, seq_len, bos))
        projected = projected_epsilon(
            state, dp, records=records, batch_size=batch_size, steps=steps
        )
        if projected > max_epsilon:
            log.warning(  # the figures stay in this node's log: epsilon reveals its data size
                "DP-SGD budget: %d more steps would take epsilon from %.3f to %.3f, above %s",
                steps,
                cumulative_epsilon(state, dp.target_delta),
                projected,
                max_epsilon,
            )
            raise BudgetExhausted(
                f"{REFUSAL_BUDGET}: more DP-SGD steps would take this client's epsilon above "
                "its max-epsilon; it stops contributing"
            )
    outcome = train_dpsgd(
        model,
        tokens,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        dp=dp,
        state=state,
        hook=hook,
        bos=bos,
    )
    ledger.save({**data, DPSGD: state})
    losses = [x for x in outcome.losses if math.isfinite(x)] or [math.nan]
    metrics = {
        **({MET_DP_TRAIN_LOSS: outcome.loss_release} if dp.metric_clip > 0 else {}),
        MET_DPSGD_EPSILON: outcome.epsilon,
        "dp-sgd-sample-rate": outcome.sample_rate,
        "dp-sgd-records": float(outcome.records),
    }
    return losses, metrics
