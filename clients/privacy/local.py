"""What the ClientApp's train handler calls for privacy: FFA-LoRA and a DP-SGD round.

Config keys (plug-in keys of ``RunConfig.extra``, sent with every message):

* ``dp-sgd-noise-multiplier``: > 0 turns sample-level DP-SGD on (0, the default, is off);
* ``dp-sgd-max-grad-norm`` (1.0), ``dp-sgd-delta`` (1e-5);
* ``dp-ffa-lora``: ``auto`` (default: on whenever DP-SGD or a DP aggregator is active),
  ``on`` or ``off``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from clients.privacy.dpsgd import STATE_RECORD, DPSGDConfig, train_dpsgd
from fedge.privacy.ffa import KEY_DPSGD_NOISE, KEY_FFA, ffa_enabled
from fedge.privacy.wire import MET_DPSGD_EPSILON
from strategies.base import ClientHook, ConfigValue

__all__ = ["KEY_FFA", "apply_ffa", "dpsgd_config", "ffa_enabled", "train_dpsgd_round"]
KEY_DPSGD_CLIP = "dp-sgd-max-grad-norm"
KEY_DPSGD_DELTA = "dp-sgd-delta"


def dpsgd_config(config: Mapping[str, ConfigValue]) -> DPSGDConfig | None:
    """The DP-SGD settings of a train message, or None when DP-SGD is off."""
    noise = float(config.get(KEY_DPSGD_NOISE, 0.0))
    if noise <= 0:
        return None
    return DPSGDConfig(
        noise_multiplier=noise,
        max_grad_norm=float(config.get(KEY_DPSGD_CLIP, 1.0)),
        target_delta=float(config.get(KEY_DPSGD_DELTA, 1e-5)),
        ffa_lora=ffa_enabled(config),
    )


def apply_ffa(model: torch.nn.Module, enabled: bool) -> None:
    """Freeze (FFA-LoRA) or unfreeze every ``lora_A`` tensor of a cached model.

    With A fixed and shared, averaging the B factors averages the updates B A exactly.
    """
    for name, param in model.named_parameters():
        if "lora_A" in name:
            param.requires_grad_(not enabled)


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
    state: RecordDict,
    seed: int,
) -> tuple[list[float], dict[str, float]]:
    """Run one round of DP-SGD; return the step losses and the metrics to report.

    The accountant history lives in ``state`` (the node's ``Context.state``) under
    ``fedge.dpsgd.accountant``, so the reported ``dp-sgd-epsilon`` is cumulative.
    """
    records = state.config_records
    if STATE_RECORD not in records:
        records[STATE_RECORD] = ConfigRecord()
    outcome = train_dpsgd(
        model,
        tokens,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        dp=dp,
        state=records[STATE_RECORD],
        hook=hook,
        seed=seed,
    )
    losses = [x for x in outcome.losses if math.isfinite(x)] or [math.nan]
    metrics = {
        MET_DPSGD_EPSILON: outcome.epsilon,
        "dp-sgd-sample-rate": outcome.sample_rate,
        "dp-sgd-records": float(outcome.records),
    }
    return losses, metrics
