"""Build a strategy from its config name: the one place that maps ``strategy`` to a class.

The same flat mapping (run config or a message's config record) also names the server
optimizer (``server-optimizer`` and its knobs) and, through ``aggregator``, the robust
combination rule and per-client bounds the strategy applies when it aggregates replies.
"""

from __future__ import annotations

from collections.abc import Mapping

from fedge import keys
from fedge.strategies.base import ConfigValue, Strategy, Weighting
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.fedprox import FedProx
from fedge.strategies.robust import AGGREGATION_RULES, RobustConfig
from fedge.strategies.scaffold import Scaffold
from fedge.strategies.server_opt import ServerOptConfig, default_server_lr

STRATEGY_NAMES = ("fedavg", "fedprox", "scaffold")
ROBUST_AGGREGATORS = tuple(r for r in AGGREGATION_RULES if r != "mean")  # values of `aggregator`


def server_opt_config(config: Mapping[str, ConfigValue]) -> ServerOptConfig:
    """The server optimizer named by ``server-optimizer`` with its knobs (defaults when absent)."""
    defaults = ServerOptConfig()
    return ServerOptConfig(
        name=str(config.get(keys.CFG_SERVER_OPTIMIZER, defaults.name)),
        momentum=float(config.get(keys.CFG_SERVER_MOMENTUM, defaults.momentum)),  # type: ignore[arg-type]
        beta1=float(config.get(keys.CFG_SERVER_BETA1, defaults.beta1)),  # type: ignore[arg-type]
        beta2=float(config.get(keys.CFG_SERVER_BETA2, defaults.beta2)),  # type: ignore[arg-type]
        tau=float(config.get(keys.CFG_SERVER_TAU, defaults.tau)),  # type: ignore[arg-type]
    )


def robust_config(config: Mapping[str, ConfigValue]) -> RobustConfig:
    """The combination rule (``aggregator`` median | trimmed-mean | krum, else the mean) and bounds."""
    aggregator = str(config.get(keys.CFG_AGGREGATOR, "plain"))
    defaults = RobustConfig()
    return RobustConfig(
        rule=aggregator if aggregator in ROBUST_AGGREGATORS else "mean",
        trim_beta=float(config.get(keys.CFG_TRIM_BETA, defaults.trim_beta)),  # type: ignore[arg-type]
        krum_malicious=int(config.get(keys.CFG_KRUM_MALICIOUS, defaults.krum_malicious)),  # type: ignore[call-overload]
        max_weight=float(config.get(keys.CFG_MAX_CLIENT_WEIGHT, defaults.max_weight)),  # type: ignore[arg-type]
        max_update_norm=float(config.get(keys.CFG_MAX_UPDATE_NORM, defaults.max_update_norm)),  # type: ignore[arg-type]
        norm_multiple=float(config.get(keys.CFG_NORM_MULTIPLE, defaults.norm_multiple)),  # type: ignore[arg-type]
        weight_multiple=float(config.get(keys.CFG_WEIGHT_MULTIPLE, defaults.weight_multiple)),  # type: ignore[arg-type]
        strict=str(config.get(keys.CFG_ROBUST_STRICT, defaults.strict)).lower() in ("true", "1"),
    )


def build_strategy(config: Mapping[str, ConfigValue]) -> Strategy:
    """Return the strategy named by ``config['strategy']`` with its knobs from the same mapping."""
    name = str(config.get(keys.CFG_STRATEGY, "fedavg"))
    optimizer = server_opt_config(config)
    server_lr = float(config.get(keys.CFG_SERVER_LR, 0.0)) or default_server_lr(optimizer.name)  # type: ignore[arg-type]
    weighting_raw = str(config.get(keys.CFG_WEIGHTING, "examples"))
    if weighting_raw not in ("examples", "uniform"):
        raise ValueError(
            f"config key '{keys.CFG_WEIGHTING}' must be 'examples' or 'uniform', got {weighting_raw!r}"
        )
    weighting: Weighting = "examples" if weighting_raw == "examples" else "uniform"
    common = {
        "server_lr": server_lr,
        "weighting": weighting,
        "server_optimizer": optimizer,
        "robust": robust_config(config),
    }
    if name == "fedavg":
        return FedAvg(**common)  # type: ignore[arg-type]
    if name == "fedprox":
        mu = float(config.get(keys.CFG_PROXIMAL_MU, 0.01))  # type: ignore[arg-type]
        return FedProx(proximal_mu=mu, **common)  # type: ignore[arg-type]
    if name == "scaffold":
        return Scaffold(**common)  # type: ignore[arg-type]
    raise ValueError(
        f"config key '{keys.CFG_STRATEGY}' is {name!r}; choose one of {', '.join(STRATEGY_NAMES)}"
    )
