"""Server optimizers (Reddi et al. 2021, https://arxiv.org/abs/2003.00295) applied to the mean delta.

Every fedge strategy ends a round with the (weighted) mean client delta, computed from
sums alone, so a server optimizer works unchanged under SecAgg+ and central DP. The
step itself is Flower's: :class:`ServerOptimizer` runs Flower's ``FedAvgM``, ``FedAdam``,
``FedYogi`` or ``FedAdagrad`` ``aggregate_train`` with the reply averaging underneath it
replaced by ``x + mean delta`` (:class:`_GivenMean` sits below the Flower class in the
method order, where ``FedAvg`` would average the replies), so Flower's momentum and
adaptive-moment math runs exactly as it does in a Flower ServerApp.
Flower keeps the moments on the strategy object; here they live in the
:class:`~fedge.strategies.contract.GlobalState` extras (``opt/m/<tensor>``, ``opt/v/<tensor>``)
and are loaded into Flower's object before each step, so they are checkpointed with the
adapter and a resumed run continues exactly.

``none`` keeps fedge's plain step, ``x <- x + server_lr * mean delta``, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi

from fedge.types import Arrays

SERVER_OPTIMIZERS = ("none", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
PREFIX_MOMENT1 = "opt/m/"  # FedAvgM's momentum buffer, FedOpt's first moment m_t
PREFIX_MOMENT2 = "opt/v/"  # FedOpt's second moment v_t
PREFIX_OPT = "opt/"
# The step size each optimizer gets when ``server-lr`` is 0 (its default): Flower's own
# defaults (FedAvgM server_learning_rate, FedAdam/FedAdagrad eta 0.1, FedYogi eta 0.01),
# and 1.0, the exact mean, for fedge's plain step.
DEFAULT_SERVER_LR = {
    "none": 1.0,
    "fedavgm": 1.0,
    "fedadam": 0.1,
    "fedyogi": 0.01,
    "fedadagrad": 0.1,
}


def default_server_lr(name: str) -> float:
    """The server step size of optimizer ``name`` when ``server-lr`` is 0 (Flower's default)."""
    if name not in DEFAULT_SERVER_LR:
        raise ValueError(
            f"server-optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {name!r}"
        )
    return DEFAULT_SERVER_LR[name]


@dataclass(frozen=True)
class ServerOptConfig:
    """The server optimizer and its knobs (its step size is the strategy's ``server-lr``)."""

    name: str = "none"
    momentum: float = 0.9  # FedAvgM (Hsu et al. 2019 use 0.9 with lr 1.0)
    beta1: float = 0.9  # FedAdam / FedYogi first moment (FedAdagrad has none)
    beta2: float = 0.99  # FedAdam / FedYogi second moment
    tau: float = 1e-3  # adaptivity: the floor under sqrt(v)

    def __post_init__(self) -> None:
        """Refuse unknown names and impossible values, naming the config key."""
        if self.name not in SERVER_OPTIMIZERS:
            raise ValueError(
                f"server-optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {self.name!r}"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"server-momentum must be in [0, 1), got {self.momentum}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(
                f"server-beta1 and server-beta2 must be in [0, 1), got {self.beta1}, {self.beta2}"
            )
        if self.tau <= 0:
            raise ValueError(f"server-tau must be > 0, got {self.tau}")


class ServerOptimizer:
    """One server step from the mean delta, with Flower's optimizer math and fedge-held state.

    ``lr`` is the step size: FedAvgM's server learning rate, FedOpt's eta (Reddi et al.
    tune it around 1e-2 to 1e-1 for FedAdam), the plain step's multiplier for ``none``.
    """

    def __init__(self, cfg: ServerOptConfig | None = None, lr: float = 1.0) -> None:
        if lr <= 0:
            raise ValueError(f"server-lr must be > 0, got {lr}")
        self.cfg = cfg or ServerOptConfig()
        self.lr = lr
        self._flower = _flower_strategy(self.cfg, lr)

    @property
    def name(self) -> str:
        """The optimizer's config name."""
        return self.cfg.name

    def init_state(self, adapter: Arrays) -> Arrays:
        """Zero moments for every tensor (Flower's own starting point), none for ``none``."""
        if self._flower is None:
            return {}
        prefixes = (
            (PREFIX_MOMENT1,) if self.cfg.name == "fedavgm" else (PREFIX_MOMENT1, PREFIX_MOMENT2)
        )
        return {
            p + k: np.zeros_like(v, dtype=np.float32) for p in prefixes for k, v in adapter.items()
        }

    def step(
        self,
        server_round: int,
        adapter: Arrays,
        delta_sum: Arrays,
        total_weight: float,
        extras: Arrays,
    ) -> tuple[Arrays, Arrays]:
        """Return (next adapter, next optimizer state) from this round's summed deltas.

        ``delta_sum`` maps adapter names to the weighted delta sums; their mean is
        ``delta_sum / total_weight``. ``extras`` holds the optimizer state (``opt/`` keys).
        """
        if self._flower is None:  # fedge's plain step, in the order it always computed it
            lr = self.lr
            return {
                k: (v + lr * delta_sum[k] / total_weight).astype(np.float32)
                for k, v in adapter.items()
            }, {}
        mean_delta = {k: delta_sum[k] / np.float32(total_weight) for k in adapter}
        state = {
            **self.init_state(adapter),
            **{k: v for k, v in extras.items() if k.startswith(PREFIX_OPT)},
        }
        names = list(adapter)
        flower = self._flower
        if isinstance(flower, FedAvgM):
            flower.current_arrays = _record(adapter)
            flower.momentum_vector = [state[PREFIX_MOMENT1 + k] for k in names]
        else:
            flower.current_arrays = {k: adapter[k] for k in names}
            flower.m_t = {k: state[PREFIX_MOMENT1 + k] for k in names}
            flower.v_t = {k: state[PREFIX_MOMENT2 + k] for k in names}
        flower.given = _record({k: adapter[k] + mean_delta[k] for k in names})  # plain averaging
        record, _ = flower.aggregate_train(server_round, [])
        if record is None:
            raise RuntimeError(f"{type(flower).__name__} returned no arrays for a valid reply")
        new = {k: np.asarray(record[k].numpy(), dtype=np.float32) for k in names}
        if isinstance(flower, FedAvgM):
            momentum = flower.momentum_vector or [state[PREFIX_MOMENT1 + k] for k in names]
            out = {
                PREFIX_MOMENT1 + k: np.asarray(m, np.float32)
                for k, m in zip(names, momentum, strict=True)
            }
        else:
            m_t, v_t = flower.m_t or {}, flower.v_t or {}
            out = {PREFIX_MOMENT1 + k: np.asarray(m_t[k], np.float32) for k in names}
            out.update({PREFIX_MOMENT2 + k: np.asarray(v_t[k], np.float32) for k in names})
        return new, out


class _GivenMean(FedAvg):
    """Where Flower's FedAvg would average the replies: returns the arrays it was given."""

    given: ArrayRecord | None = None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Return ``x + mean delta`` as if it were the replies' weighted mean."""
        return self.given, None


class _FedAvgM(FedAvgM, _GivenMean):
    """Flower's FedAvgM step on a given mean."""


class _FedAdam(FedAdam, _GivenMean):
    """Flower's FedAdam step on a given mean."""


class _FedYogi(FedYogi, _GivenMean):
    """Flower's FedYogi step on a given mean."""


class _FedAdagrad(FedAdagrad, _GivenMean):
    """Flower's FedAdagrad step on a given mean."""


_FlowerStep = _FedAvgM | _FedAdam | _FedYogi | _FedAdagrad


def _flower_strategy(cfg: ServerOptConfig, lr: float) -> _FlowerStep | None:
    """Flower's strategy object whose aggregation step is the optimizer (None for ``none``)."""
    if cfg.name == "fedavgm":
        return _FedAvgM(server_learning_rate=lr, server_momentum=cfg.momentum)
    if cfg.name == "fedadam":
        return _FedAdam(eta=lr, beta_1=cfg.beta1, beta_2=cfg.beta2, tau=cfg.tau)
    if cfg.name == "fedyogi":
        return _FedYogi(eta=lr, beta_1=cfg.beta1, beta_2=cfg.beta2, tau=cfg.tau)
    if cfg.name == "fedadagrad":
        return _FedAdagrad(eta=lr, tau=cfg.tau)
    return None


def _record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord(
        {k: Array(np.ascontiguousarray(v, dtype=np.float32)) for k, v in arrays.items()}
    )
