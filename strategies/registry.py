"""Build a strategy from its config name: the one place that maps ``strategy`` to a class."""

from __future__ import annotations

from collections.abc import Mapping

from fedge import keys
from strategies.base import ConfigValue, Strategy, Weighting
from strategies.fedavg import FedAvg
from strategies.fedprox import FedProx
from strategies.scaffold import Scaffold

STRATEGY_NAMES = ("fedavg", "fedprox", "scaffold")


def build_strategy(config: Mapping[str, ConfigValue]) -> Strategy:
    """Return the strategy named by ``config['strategy']`` with its knobs from the same mapping."""
    name = str(config.get(keys.CFG_STRATEGY, "fedavg"))
    server_lr = float(config.get(keys.CFG_SERVER_LR, 1.0))
    weighting_raw = str(config.get(keys.CFG_WEIGHTING, "examples"))
    if weighting_raw not in ("examples", "uniform"):
        raise ValueError(
            f"config key '{keys.CFG_WEIGHTING}' must be 'examples' or 'uniform', got {weighting_raw!r}"
        )
    weighting: Weighting = "examples" if weighting_raw == "examples" else "uniform"
    if name == "fedavg":
        return FedAvg(server_lr=server_lr, weighting=weighting)
    if name == "fedprox":
        mu = float(config.get(keys.CFG_PROXIMAL_MU, 0.01))
        return FedProx(proximal_mu=mu, server_lr=server_lr, weighting=weighting)
    if name == "scaffold":
        return Scaffold(server_lr=server_lr, weighting=weighting)
    raise ValueError(
        f"config key '{keys.CFG_STRATEGY}' is {name!r}; choose one of {', '.join(STRATEGY_NAMES)}"
    )
