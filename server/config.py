"""The federation's one configuration type: server knobs plus the client's :class:`TrainConfig`.

Every source of configuration is a flat mapping of hyphenated keys (constants in
:mod:`fedge.keys`): ``[tool.flwr.app.config]`` in ``pyproject.toml`` (``flwr
run``), a scenario TOML under ``simulations/scenarios`` (``fedge simulate``), and
``--set key=value`` overrides. :meth:`RunConfig.from_mapping` validates all of
them the same way; the client half travels to clients inside every message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedge import keys
from fedge.lm.config import TrainConfig, coerce, config_key
from fedge.strategies.registry import (
    ROBUST_AGGREGATORS,
    STRATEGY_NAMES,
    robust_config,
    server_opt_config,
)
from fedge.types import ConfigValue

EXTENSION_PREFIXES = ("dp-", "secagg-", "privacy-", "device-", "straggler-", "distill-", "x-")
"""Keys with these prefixes belong to plug-ins (aggregators, mods, budgets, device simulation
in ``fedge.simulations.devices``); they are kept
as strings/numbers in ``RunConfig.extra`` and sent to clients with every message."""


@dataclass(frozen=True)
class RunConfig:
    """Everything one federated run needs; a field's key is its name with '-' for '_'."""

    num_server_rounds: int = 3
    strategy: str = "fedavg"
    server_lr: float = 0.0  # server step (plain x, FedAvgM lr, FedOpt eta); 0: the optimizer's own
    server_optimizer: str = "none"  # none | fedavgm | fedadam | fedyogi | fedadagrad
    server_momentum: float = 0.9  # FedAvgM (Hsu et al. 2019)
    server_beta1: float = 0.9  # FedAdam / FedYogi (Reddi et al. 2021)
    server_beta2: float = 0.99
    server_tau: float = 1e-3  # FedOpt's adaptivity floor; larger is closer to FedAvgM
    proximal_mu: float = 0.01  # FedProx's mu; small, since LoRA deltas are small
    weighting: str = "examples"
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    min_available_nodes: int = 2
    round_timeout: float = 900.0  # seconds to wait for train replies
    target_reports: int = 0  # K, reports a round wants; 0: max(min-train-nodes, fraction x N)
    over_selection: float = 0.0  # sample K (1 + x) nodes for K reports (Bonawitz et al.: 0.3)
    seed: int = 0
    model: str = "zoo:micro"  # a model dir, a hub id, or "zoo:<preset>"
    partition_scheme: str = "natural"
    num_partitions: int = 0  # iid/dirichlet: 0 = one per connected node; natural: must be 0
    dirichlet_alpha: float = 0.5
    max_chars_per_client: int = 20000  # characters per client; 0: no cap (the whole package)
    data_source: str = ""  # "" = the stdlib corpus; else a directory of your own text
    # text: the corpus as token streams; instructions: the stdlib's functions as code
    # instructions, one client per package, only the response scored (fedge.data.instructions)
    data_kind: str = "text"
    server_eval_batches: int = 16  # held-out windows of seq-len for server perplexity
    client_eval: bool = True  # ask the round's clients for held-out loss too
    run_dir: str = ""  # "" under `flwr run`: runs/flwr-<utc time>
    aggregator: str = "plain"  # plain | median | trimmed-mean | krum | package.module:factory
    trimmed_mean_beta: float = 0.2  # Flower's default cut per tail
    krum_malicious: int = 0  # Krum's f
    max_client_weight: float = 0.0  # weight cap (0: none; SecAgg+: the sum is checked)
    max_update_norm: float = 0.0  # L2 bound of ||delta/weight|| (0: none; SecAgg+: the sum)
    norm_bound_multiple: float = 3.0  # plain: refuse updates above x the round's median norm
    weight_cap_multiple: float = 3.0  # plain: cap weights at x the round's median weight
    robust_strict: bool = False  # refuse a round whose robust rule is too small for it
    max_rejected_rounds: int = (
        keys.DEFAULT_MAX_REJECTED_ROUNDS
    )  # stop after this many rejected SecAgg+ sums (0: never)
    privacy_budget: str = ""
    max_epsilon: float = 0.0  # 0: no budget stop
    plateau_patience: int = 0  # stop after this many rounds without improving (server/plateau.py)
    plateau_min_improvement: float = 0.0  # the relative drop in perplexity that counts
    client_mods: str = ""
    client_state_dir: str = ""  # "" keeps SCAFFOLD's c_i in the node's Context
    save_merged: bool = True  # also write base+adapter merged for serving
    plots: bool = True  # perplexity.png and privacy.png when the run ends
    tensorboard: bool = True  # round metrics as TensorBoard scalars in <run-dir>/tensorboard
    mlflow: str = ""  # "": off; "local": file store <run-dir>/mlruns; else an MLflow tracking URI
    run_id: str = ""  # "": the server draws a random id at a fresh start (namespaces client state)
    train: TrainConfig = field(default_factory=TrainConfig)
    extra: Mapping[str, ConfigValue] = field(default_factory=dict)  # keys under EXTENSION_PREFIXES

    def __post_init__(self) -> None:
        """Validate ranges and names, naming the key and the value."""
        if self.num_server_rounds <= 0:
            raise ValueError(f"num-server-rounds must be > 0, got {self.num_server_rounds}")
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(
                f"strategy must be one of {', '.join(STRATEGY_NAMES)}, got {self.strategy!r}"
            )
        if self.weighting not in ("examples", "uniform"):
            raise ValueError(f"weighting must be 'examples' or 'uniform', got {self.weighting!r}")
        if not 0 < self.fraction_train <= 1:
            raise ValueError(f"fraction-train must be in (0, 1], got {self.fraction_train}")
        if self.min_train_nodes <= 0 or self.min_available_nodes <= 0:
            raise ValueError("min-train-nodes and min-available-nodes must be > 0")
        if self.partition_scheme not in ("natural", "iid", "dirichlet"):
            raise ValueError(
                f"partition-scheme must be natural, iid or dirichlet, got {self.partition_scheme!r}"
            )
        if self.data_kind not in keys.DATA_KINDS:
            raise ValueError(f"data-kind must be one of {keys.DATA_KINDS}, got {self.data_kind!r}")
        if self.data_kind == "instructions" and (
            self.data_source or self.partition_scheme != "natural"
        ):
            raise ValueError(
                "data-kind=instructions is the stdlib's functions by package: it takes no "
                "data-source and partition-scheme natural"
            )
        if self.partition_scheme == "natural" and self.num_partitions != 0:
            raise ValueError(
                f"num-partitions={self.num_partitions} does not apply to partition-scheme=natural "
                "(one client per package); set it to 0, or use partition-scheme=iid or dirichlet"
            )
        if self.num_partitions < 0:
            raise ValueError(f"num-partitions must be >= 0, got {self.num_partitions}")
        if self.server_lr < 0 or self.proximal_mu < 0 or self.round_timeout <= 0:
            raise ValueError(
                "server-lr must be >= 0 (0: the optimizer's own default), round-timeout > 0 and "
                "proximal-mu >= 0"
            )
        if self.max_rejected_rounds < 0:
            raise ValueError(f"max-rejected-rounds must be >= 0, got {self.max_rejected_rounds}")
        if self.over_selection < 0 or self.target_reports < 0:
            raise ValueError(
                f"over-selection and target-reports must be >= 0, got {self.over_selection} "
                f"and {self.target_reports}"
            )
        if self.max_epsilon < 0:
            raise ValueError(f"max-epsilon must be >= 0, got {self.max_epsilon}")
        if self.plateau_patience < 0 or not 0 <= self.plateau_min_improvement < 1:
            raise ValueError(
                f"plateau-patience must be >= 0 and plateau-min-improvement in [0, 1), got "
                f"{self.plateau_patience} and {self.plateau_min_improvement}"
            )
        if self.mlflow not in ("", "local") and ":" not in self.mlflow:
            raise ValueError(
                f'mlflow must be "" (off), "local" (<run-dir>/mlruns) or a tracking URI such '
                f'as "sqlite:///path/mlflow.db" or "http://host:5000", got {self.mlflow!r}'
            )
        if self.aggregator not in ("plain", *ROBUST_AGGREGATORS) and ":" not in self.aggregator:
            raise ValueError(
                f"aggregator must be plain, {', '.join(ROBUST_AGGREGATORS)} or "
                f"'package.module:factory', got {self.aggregator!r}"
            )
        mapping = self.to_mapping()
        server_opt_config(mapping)  # raises naming the server-* key that is out of range
        robust_config(mapping)  # raises naming the robust-aggregation key that is out of range

    # ------------------------------------------------------------ mappings
    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> RunConfig:
        """Build from flat hyphenated keys; an unknown key is an error that lists the known ones."""
        server_fields = {
            config_key(f.name): f
            for f in dataclasses.fields(cls)
            if f.name not in ("train", "extra")
        }
        train_keys = set(TrainConfig().to_config())
        known = server_fields.keys() | train_keys
        extra = {
            k: v for k, v in mapping.items() if k not in known and k.startswith(EXTENSION_PREFIXES)
        }
        unknown = sorted(k for k in mapping if k not in known and k not in extra)
        if unknown:
            raise ValueError(
                f"unknown config key(s) {unknown}; known keys: "
                f"{', '.join(sorted(known))} (plug-in keys start with {', '.join(EXTENSION_PREFIXES)})"
            )
        defaults = cls()
        values: dict[str, Any] = {
            f.name: coerce(k, mapping[k], type(getattr(defaults, f.name)))
            for k, f in server_fields.items()
            if k in mapping and f.name != "extra"
        }
        train = TrainConfig.from_config({k: v for k, v in mapping.items() if k in train_keys})
        return cls(train=train, extra=extra, **values)

    def to_mapping(self) -> dict[str, ConfigValue]:
        """Return every key, flat (server keys, then the client's)."""
        out: dict[str, ConfigValue] = {
            config_key(f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("train", "extra")
        }
        out.update(self.train.to_config())
        out.update(self.extra)
        return out

    def with_overrides(self, overrides: Mapping[str, Any]) -> RunConfig:
        """Return a copy with some flat keys replaced (validated like the rest)."""
        return RunConfig.from_mapping({**self.to_mapping(), **overrides})

    def client_config(self) -> dict[str, ConfigValue]:
        """The keys every client message carries: data, model, training, mods, seed."""
        out: dict[str, ConfigValue] = dict(self.train.to_config())
        for key in (
            keys.CFG_MODEL,
            keys.CFG_PARTITION_SCHEME,
            keys.CFG_NUM_PARTITIONS,
            keys.CFG_DIRICHLET_ALPHA,
            keys.CFG_MAX_CHARS_PER_CLIENT,
            keys.CFG_DATA_SOURCE,
            keys.CFG_DATA_KIND,
            keys.CFG_SEED,
            keys.CFG_CLIENT_MODS,
            keys.CFG_CLIENT_STATE_DIR,
            keys.CFG_MAX_EPSILON,  # clients' DP-SGD accountants stop before passing it
            keys.CFG_MAX_CLIENT_WEIGHT,  # under SecAgg+ each client clips itself to these
            keys.CFG_MAX_UPDATE_NORM,
            keys.CFG_RUN_ID,
        ):
            out[key] = self.to_mapping()[key]
        out.update(self.extra)
        return out
