"""Aggregator and budget factories named by the run config (``aggregator``, ``privacy-budget``).

Settings are plug-in keys of ``RunConfig.extra`` (all optional):

==========================  =========  ==================================================
key                         default    meaning
==========================  =========  ==================================================
``dp-clip-norm``            1.0        C: L2 bound of one client's update (delta + ctrl)
``dp-noise-multiplier``     1.0        z: the round's sum carries N(0, (z C)^2)
``dp-target-delta``         1e-5       delta at which epsilon is reported and budgeted
``dp-accountant``           rdp        rdp | pld: how epsilon is computed (PLD is tighter)
``dp-min-survival``         0.8        distributed DP: fraction of sampled clients a round needs
``secagg-num-shares``       0          0: 2 ceil(log2 n) + 1; <= 1: fraction of n; else a count
``secagg-threshold``        0.667      <= 1: fraction of the neighbours; else a count
``secagg-clipping-range``   8.0        values (after scaling) must lie in [-R, R]
``secagg-max-weight``       1000       with example weighting: divisor of delta/ and meta/weight
``secagg-stage-timeout``    60         seconds each protocol stage waits for replies
==========================  =========  ==================================================

``max-epsilon`` (a RunConfig field) is the budget; 0 disables the stop. It applies whenever it
is set: to the server's accountant and to every client's DP-SGD accountant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fedge.privacy.wire import KEY_ACCOUNTANT, KEY_DPSGD_NOISE
from fedge.secagg.config import DEFAULT_MAX_WEIGHT, SecAggConfig, weight_scales
from fedge.server.aggregation import PlainAggregator
from fedge.server.budget import NoBudget, PrivacyBudget
from fedge.server.config import RunConfig
from fedge.server.privacy.accountant import DPBudget
from fedge.server.privacy.aggregators import CentralDPAggregator, DistributedDPAggregator
from fedge.server.privacy.config import DPConfig, DPMode
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.strategies.base import ConfigValue
from fedge.strategies.registry import robust_config
from fedge.strategies.robust import RobustConfig


def _num(extra: Mapping[str, ConfigValue], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config key '{key}' must be a number, got {value!r}") from exc


def _count_or_fraction(value: float) -> int | float:
    return int(value) if value > 1 else float(value)


def secagg_config(cfg: RunConfig) -> SecAggConfig:
    """SecAgg+ settings from the run config; example weighting gets divisors for big values."""
    x = cfg.extra
    shares = _num(x, "secagg-num-shares", 0.0)
    scales = weight_scales(cfg.weighting, _num(x, "secagg-max-weight", DEFAULT_MAX_WEIGHT))
    return SecAggConfig(
        num_shares=None if shares == 0 else _count_or_fraction(shares),
        reconstruction_threshold=_count_or_fraction(_num(x, "secagg-threshold", 2 / 3)),
        clipping_range=_num(x, "secagg-clipping-range", 8.0),
        stage_timeout_s=_num(x, "secagg-stage-timeout", 60.0),
        key_scales=scales,
    )


def dp_config(cfg: RunConfig, mode: DPMode) -> DPConfig:
    """DP settings from the run config; DP needs uniform weighting to bound one client's influence."""
    if cfg.weighting != "uniform":
        raise ValueError(
            f'differential privacy needs weighting = "uniform" (got {cfg.weighting!r}): with '
            "example weighting one client's weight, and so its influence, is unbounded"
        )
    x = cfg.extra
    sampling = str(x.get("dp-sampling", "none"))
    if sampling != "none":
        raise ValueError(
            f"dp-sampling={sampling!r} is not supported: amplification by sampling needs clients "
            "sampled with randomness the adversary cannot know, and fedge's round loop samples "
            "with the run's seed; every round is accounted as a full release (remove the key)"
        )
    return DPConfig(
        mode=mode,
        clip_norm=_num(x, "dp-clip-norm", 1.0),
        noise_multiplier=_num(x, "dp-noise-multiplier", 1.0),
        target_delta=_num(x, "dp-target-delta", 1e-5),
        max_epsilon=cfg.max_epsilon,
        accountant=str(x.get(KEY_ACCOUNTANT, "rdp")),  # type: ignore[arg-type]  # validated
        min_survival=_num(x, "dp-min-survival", 0.8),
    )


def secagg(cfg: RunConfig) -> SecAggPlusAggregator:
    """``aggregator = "fedge.server.privacy.factories:secagg"``: SecAgg+ without DP."""
    return SecAggPlusAggregator(secagg_config(cfg), robust_config(cfg.to_mapping()))


def central_dp(cfg: RunConfig) -> CentralDPAggregator:
    """``aggregator = "fedge.server.privacy.factories:central_dp"``: clip + noise on the server.

    The inner sum is exact: the clip to C is the defence, and the default one (refusing an
    update relative to the round's median norm) would make one client's presence depend on
    the others' data, so the sum could move by more than C (the noise's sensitivity)."""
    exact = RobustConfig(norm_multiple=0.0, weight_multiple=0.0)
    return CentralDPAggregator(PlainAggregator(exact), dp_config(cfg, "central"))


def secagg_distributed_dp(cfg: RunConfig) -> DistributedDPAggregator:
    """``aggregator = "fedge.server.privacy.factories:secagg_distributed_dp"``: clients noise, SecAgg+ sums."""
    return DistributedDPAggregator(
        SecAggPlusAggregator(secagg_config(cfg), robust_config(cfg.to_mapping())),
        dp_config(cfg, "distributed"),
    )


def rdp_budget(cfg: RunConfig) -> DPBudget:
    """``privacy-budget = "fedge.server.privacy.factories:rdp_budget"``: RDP epsilon, max-epsilon stop."""
    return DPBudget(dataclasses.replace(dp_config(cfg, "central"), accountant="rdp"))


def pld_budget(cfg: RunConfig) -> DPBudget:
    """``privacy-budget = "fedge.server.privacy.factories:pld_budget"``: the tighter PLD epsilon."""
    return DPBudget(dataclasses.replace(dp_config(cfg, "central"), accountant="pld"))


def default_budget(cfg: RunConfig, aggregator: object) -> PrivacyBudget:
    """The budget of a run that names no ``privacy-budget``.

    A DP aggregator's releases are always accounted (``dp-accountant``, RDP by default),
    so epsilon is reported and ``max-epsilon`` stops the run. Without one, ``max-epsilon``
    can only be enforced by the clients' DP-SGD accountants; set anywhere else it would
    silently do nothing, so it is an error.
    """
    dp = getattr(aggregator, "cfg", None)
    if isinstance(dp, DPConfig):
        return DPBudget(dp)
    dpsgd = _num(cfg.extra, KEY_DPSGD_NOISE, 0.0) > 0
    if cfg.max_epsilon > 0 and not dpsgd:
        raise ValueError(
            f"max-epsilon={cfg.max_epsilon} is set, but this run applies no differential privacy "
            "to account: use a DP aggregator (fedge.server.privacy.factories:central_dp or "
            "secagg_distributed_dp) or DP-SGD (dp-sgd-noise-multiplier > 0), or remove max-epsilon"
        )
    return NoBudget()
