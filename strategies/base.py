"""The strategy contract: aggregation as a sum of per-client contributions, plus client hooks.

A federated strategy here is two halves that never touch transport, privacy or I/O
(the split pfl-research uses, see ``docs/federation.md``):

Client half (runs inside the ClientApp, on the client's machine)
    1. ``Strategy.client_hook(payload, state)`` returns a :class:`ClientHook` that the
       local trainer calls: ``regularizer`` adds a loss term (FedProx),
       ``correct_gradients`` edits gradients after ``backward`` (SCAFFOLD), and
       ``finish`` returns the strategy's extra arrays (SCAFFOLD's control delta) and
       the client state to persist (SCAFFOLD's ``c_i``).
    2. :func:`build_contribution` turns the local result into ONE flat dict of
       float32 arrays, the *contribution* (keys in :mod:`fedge.keys`)::

           delta/<name>  = weight * (local - global)      for every adapter tensor
           ctrl/<name>   = c_i+ - c_i                      SCAFFOLD only
           meta/weight   = [weight]                        num_examples, or 1 ("uniform")
           meta/count    = [1]                             0 when the work is dropped

       A dropped client (a straggler under a strategy that refuses partial work)
       contributes all zeros, so dropping needs no side channel.

Server half (pure math on sums)
    3. Whatever aggregator is plugged into the round loop returns the element-wise
       SUM of the contributions over the clients of a round.
    4. ``Strategy.finalize(state, summed, population)`` maps the sum to the next
       :class:`GlobalState` (adapter plus strategy state such as SCAFFOLD's ``c``).

Because the server only ever needs the sum, the following plug in WITHOUT editing
any strategy:

* **Secure aggregation (SecAgg+)**: an aggregator that sends the train messages with
  its own protocol stages, lets a client mod mask the ``contribution`` record, and
  returns the unmasked sum with the same keys. The loop and ``finalize`` are unchanged.
* **Central DP**: an aggregator wrapper that clips each contribution's SENSITIVE part
  (all ``delta/`` and ``ctrl/`` keys jointly, one L2 norm) to ``C``, sums, and adds
  Gaussian noise ``N(0, (z C)^2)`` to the sensitive sum; plus :class:`UniformWeighting`
  around the strategy so every client sends ``meta/weight = 1`` (the clipped
  contribution then bounds one client's influence). ``meta/`` keys are public.
* **Distributed DP**: a client mod clips the sensitive part locally and adds its
  share of the noise, ``N(0, (z C)^2 / n)``, before SecAgg masks it; the server
  side is :class:`UniformWeighting` plus the SecAgg aggregator.
* **Privacy budget**: the round loop asks a budget guard before every release and
  stops cleanly, after a checkpoint, when the next round would exceed ``max-epsilon``.

SCAFFOLD's control delta is summed together with the adapter delta, so a DP
mechanism's sensitivity bound covers both parts of the one vector.

Every fedge strategy is also a Flower strategy
(``flwr.serverapp.strategy.FedAvg`` is its base class), so a plain Flower ServerApp
runs it with ``strategy.start(grid=..., initial_arrays=..., num_rounds=...)``:
``configure_train`` is Flower's (node sampling, ``server-round``) plus the strategy's
config keys and payload record; ``aggregate_train`` reads each reply as a contribution
(:mod:`fedge.strategies.replies`: fedge's own or a Flower quickstart reply), applies the
per-client bounds and the combination rule (:mod:`fedge.strategies.robust`), and calls
``finalize``, whose step is the server optimizer (:mod:`fedge.strategies.server_opt`).
Evaluation is Flower's FedAvg unchanged. The client half for any torch ClientApp is
:class:`fedge.strategies.client.TrainRound`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log as flower_log
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedge import keys
from fedge.strategies.arrays import array_numpy
from fedge.strategies.contract import (
    ClientHook,
    ClientResult,
    ClientStateStore,
    GlobalState,
    Weighting,
    build_contribution,
    client_weight,
    replace_state,
    sum_contributions,
)
from fedge.strategies.flower_dp import refuse_flower_dp_wrapper
from fedge.strategies.replies import reply_contribution
from fedge.strategies.robust import RobustConfig, adaptive_bounds, apply_bounds, robust_sum
from fedge.strategies.server_opt import (
    PREFIX_OPT,
    ServerOptConfig,
    ServerOptimizer,
    default_server_lr,
)
from fedge.types import Arrays, ConfigValue

if TYPE_CHECKING:
    import torch

__all__ = [
    "Arrays",
    "CheckedStart",
    "ClientHook",
    "ClientResult",
    "ClientStateStore",
    "ConfigValue",
    "GlobalState",
    "NoReplyAccepted",
    "Strategy",
    "UniformWeighting",
    "Weighting",
    "build_contribution",
    "client_weight",
    "log_received",
    "replace_state",
    "sum_contributions",
]

log = logging.getLogger(__name__)

_Checked = TypeVar("_Checked")  # what an accepted reply's contribution becomes (accept_replies)


def log_received(replies: Sequence[Message]) -> None:
    """Flower FedAvg's own line, in Flower's log, for the replies fedge reads itself."""
    failures = sum(1 for msg in replies if msg.has_error())
    flower_log(
        INFO,
        "aggregate_train: Received %s results and %s failures",
        len(replies) - failures,
        failures,
    )


class NoReplyAccepted(AggregationError):
    """A run whose every round ended without one accepted reply: its model is the initial one."""


def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """numpy arrays -> ArrayRecord of contiguous float32 copies (what clients expect)."""
    return ArrayRecord(
        {k: Array(np.ascontiguousarray(v, dtype=np.float32)) for k, v in arrays.items()}
    )


class CheckedStart(FlowerStrategy):
    """Flower's ``start`` between a run's reset and its :class:`NoReplyAccepted` check.

    A fedge strategy and the wrappers around one (``fedge.server.secagg.strategy.SecAggPlus``,
    ``fedge.server.privacy.strategy.CentralDP``) count a run's rounds in the fedge strategy
    (:meth:`Strategy.reset_run`, :meth:`Strategy.check_applied`); each says only how it
    resets a run (``reset_run``) and what it knows of the last round's refusals
    (``check_run``).
    """

    @abstractmethod
    def reset_run(self) -> None:
        """Forget the previous run's rounds; ``start`` calls it first."""

    @abstractmethod
    def check_run(self) -> None:
        """Raise :class:`NoReplyAccepted` when no round of the run just ended applied an
        accepted update; ``start`` calls it after Flower's ``start`` returned."""

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``start``; a run in which no reply (or, under a secure aggregator, no
        round's sum) was ever applied raises :class:`NoReplyAccepted` instead of returning
        the initial model."""
        self.reset_run()
        result = super().start(
            grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn
        )
        self.check_run()
        return result


class Strategy(CheckedStart, FlowerFedAvg, ABC):
    """A federated optimisation algorithm as knobs, a client hook and a ``finalize`` step.

    Subclasses set ``name``, ``accepts_partial_work`` and ``local_optimizer`` and override
    what differs. ``server_lr`` is the server step size (0, the default: the optimizer's
    own, Flower's: 1.0 for "none", which reproduces plain averaging, and FedAvgM, 0.1 for
    FedAdam and FedAdagrad, 0.01 for FedYogi); ``server_optimizer`` picks FedAvgM/FedAdam/
    FedYogi/FedAdagrad; ``robust`` the combination rule and per-client bounds used when
    the strategy aggregates replies itself (inside a Flower ServerApp). ``population``
    is SCAFFOLD's N there (0: the nodes connected at each round). ``flower_options``
    are Flower FedAvg's sampling options (``fraction_train``, ``min_train_nodes``, ...).
    """

    name: ClassVar[str]
    accepts_partial_work: ClassVar[bool] = False
    local_optimizer: ClassVar[str] = "adamw"  # what `optimizer = "auto"` means on the client

    def __init__(
        self,
        server_lr: float = 0.0,
        weighting: Weighting = "examples",
        *,
        server_optimizer: ServerOptConfig | None = None,
        robust: RobustConfig | None = None,
        population: int = 0,
        **flower_options: Any,
    ) -> None:
        super().__init__(**flower_options)
        if server_lr < 0:
            raise ValueError(f"server_lr must be >= 0 (0: the optimizer's own), got {server_lr}")
        server_lr = server_lr or default_server_lr((server_optimizer or ServerOptConfig()).name)
        if weighting not in ("examples", "uniform"):
            raise ValueError(f"weighting must be 'examples' or 'uniform', got {weighting!r}")
        if population < 0:
            raise ValueError(f"population must be >= 0 (0: the connected nodes), got {population}")
        self.server_lr = server_lr
        self.weighting: Weighting = weighting
        self.optimizer = ServerOptimizer(server_optimizer, server_lr)
        self.robust = robust or RobustConfig()
        self.population = population
        self.flower_options = dict(flower_options)
        self._round_state: GlobalState | None = None  # Flower ServerApp use: state between rounds
        self._round_population = 0
        # Flower ServerApp use: node id -> the last round whose aggregate holds that node's
        # contribution, sent back to the sampled nodes so their client state (SCAFFOLD's c_i)
        # advances only with what the server accepted (fedge's own ServerApp does the same
        # by partition, fedge.server.loop)
        self.committed: dict[int, int] = {}
        self._rounds_sent = 0  # rounds whose train messages went out
        self._rounds_applied = 0  # rounds whose aggregate held at least one accepted update
        self._last_refusals: dict[int, str] = {}  # node -> why, in the latest round

    # ------------------------------------------------------------ server side
    def init_extras(self, adapter: Arrays) -> Arrays:
        """Return the strategy's initial server state for a fresh run (the optimizer's moments)."""
        return self.optimizer.init_state(adapter)

    def client_config(self, server_round: int) -> dict[str, ConfigValue]:
        """Return the config keys every train message carries for this strategy."""
        return {
            keys.CFG_STRATEGY: self.name,
            keys.CFG_WEIGHTING: self.weighting,
            keys.CFG_ACCEPT_PARTIAL: self.accepts_partial_work,
        }

    def client_payload(self, state: GlobalState) -> Arrays:
        """Return arrays sent beside the adapter in the ``strategy`` record (default: none)."""
        return {}

    def contribution_spec(self, state: GlobalState) -> dict[str, tuple[int, ...]]:
        """Return the exact keys and shapes a valid contribution has this round."""
        spec = {keys.PREFIX_DELTA + k: v.shape for k, v in state.adapter.items()}
        spec[keys.KEY_WEIGHT] = (1,)
        spec[keys.KEY_COUNT] = (1,)
        return spec

    def finalize(self, state: GlobalState, summed: Arrays, population: int) -> GlobalState:
        """Apply one round's summed contributions: the server optimizer steps on sum(w d) / sum(w)."""
        total_weight = float(summed[keys.KEY_WEIGHT][0])
        if total_weight <= 0:
            raise ValueError(
                f"round {state.server_round + 1}: the summed weight is {total_weight}; "
                "no client contributed, so there is nothing to average"
            )
        delta_sum = {k: summed[keys.PREFIX_DELTA + k] for k in state.adapter}
        adapter, opt_state = self.optimizer.step(
            state.server_round + 1, state.adapter, delta_sum, total_weight, state.extras
        )
        extras = {k: v for k, v in state.extras.items() if not k.startswith(PREFIX_OPT)}
        return GlobalState(adapter, {**extras, **opt_state}, state.server_round + 1)

    # ------------------------------------------------------------ Flower's Strategy contract
    @property
    def round_state(self) -> GlobalState | None:
        """Inside a Flower ServerApp: the state after the last round (None before the first)."""
        return self._round_state

    def summary(self) -> None:
        """Log fedge's settings, then Flower FedAvg's."""
        log.info(
            "fedge %s: server optimizer %s (lr %g), rule %s, weighting %s",
            self.name,
            self.optimizer.name,
            self.server_lr,
            self.robust.rule,
            self.weighting,
        )
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's sampling and messages, plus this strategy's config keys and payload record."""
        refuse_flower_dp_wrapper(self)  # Flower's DP wrappers misread fedge's replies
        adapter = {k: np.asarray(array_numpy(v), dtype=np.float32) for k, v in arrays.items()}
        held = self._round_state
        extras = (
            held.extras
            if held is not None and set(held.adapter) == set(adapter)
            else self.init_extras(adapter)
        )
        self._round_state = GlobalState(adapter, extras, server_round - 1)
        self._round_population = self.population or len(list(grid.get_node_ids()))
        for key, value in self.client_config(server_round).items():
            config[key] = value
        messages = list(super().configure_train(server_round, arrays, config, grid))
        nodes = sorted({m.metadata.dst_node_id for m in messages})
        config[keys.CFG_COMMITTED_NODES] = nodes  # the messages share this one ConfigRecord
        config[keys.CFG_COMMITTED_NODE_ROUNDS] = [self.committed.get(n, 0) for n in nodes]
        self._rounds_sent += bool(messages)
        payload = self.client_payload(self._round_state)
        if payload:  # one record for all: serializing it per message cost 2 ms per node
            record = to_array_record(payload)
            for message in messages:
                message.content[keys.REC_STRATEGY] = record
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Replies -> bounded contributions -> the rule's sum -> ``finalize`` -> next arrays."""
        accepted = self.accept_replies(
            server_round, replies, lambda arrays: apply_bounds(arrays, self.robust)
        )
        nodes = [node for node, _, _ in accepted]
        kept_arrays, refused = adaptive_bounds(  # the default defence
            [arrays for _, arrays, _ in accepted], self.robust
        )
        for index, why in sorted(refused.items()):
            self._refuse(server_round, nodes[index], why)
        contents = [c for i, (_, _, c) in enumerate(accepted) if i not in refused]
        nodes = [n for i, n in enumerate(nodes) if i not in refused]
        if not kept_arrays:
            log.error("round %d: no reply was accepted; the global model is kept", server_round)
            return None, None
        summed, kept = self.combine(kept_arrays)
        record = self.aggregate_sum(server_round, summed, [nodes[i] for i in kept])
        return record, self._train_metrics(contents)

    def accept_replies(
        self,
        server_round: int,
        replies: Iterable[Message],
        check: Callable[[Arrays], tuple[_Checked | None, str | None]],
    ) -> list[tuple[int, _Checked, RecordDict]]:
        """Read the open round's replies as contributions; ``check`` refuses one (a reason) or
        turns it into what the caller sums (per-client bounds here, unit weight under central DP).

        Logs Flower's "Received" line; every error reply, unreadable reply and reply that
        ``check`` refuses is logged and kept for :meth:`check_applied` (:meth:`_refuse`).
        Returns (node, what ``check`` made of its contribution, reply content) per accepted reply.
        """
        state = self._round_state
        if state is None:
            raise AggregationError("aggregate_train before configure_train: no round is open")
        spec = self.contribution_spec(state)
        replies = list(replies)
        log_received(replies)
        accepted: list[tuple[int, _Checked, RecordDict]] = []
        self._last_refusals = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                log.warning(
                    "round %d: node %d replied with an error: %s",
                    server_round,
                    node,
                    msg.error.reason,
                )
                self._last_refusals[node] = f"error reply: {msg.error.reason}"
                continue
            arrays, why = reply_contribution(msg.content, state.adapter, spec, self.weighted_by_key)
            checked: _Checked | None = None
            if arrays is not None and why is None:
                checked, why = check(arrays)
            if checked is None or why is not None:
                self._refuse(server_round, node, str(why))
                continue
            accepted.append((node, checked, msg.content))
        return accepted

    def _refuse(self, server_round: int, node: int, why: str) -> None:
        """Log a refused reply and keep why, for :meth:`check_applied`'s message."""
        log.warning("round %d: rejected the reply of node %d: %s", server_round, node, why)
        self._last_refusals[node] = why

    def combine(self, contributions: list[Arrays]) -> tuple[Arrays, list[int]]:
        """The round's combination rule over the accepted contributions (in the shape of a
        sum) and the indices of those whose whole update it holds (their client state commits)."""
        kept = [i for i, c in enumerate(contributions) if float(c[keys.KEY_COUNT][0]) > 0]
        return robust_sum(contributions, self.robust), kept

    def aggregate_sum(
        self, server_round: int, summed: Arrays, contributors: Iterable[int] = ()
    ) -> ArrayRecord:
        """The round's summed contributions -> ``finalize`` -> next arrays; a secure aggregator
        that hands over only the sum (``fedge.server.secagg.strategy``) enters here.

        ``contributors`` are the nodes whose contributions the sum holds: once the sum is
        applied, their client state of this round is committed (sent back next round).
        """
        state = self._round_state
        if state is None:
            raise AggregationError("aggregate_sum before configure_train: no round is open")
        if float(summed[keys.KEY_WEIGHT][0]) > 0:
            state = self.finalize(state, summed, self._round_population)
            self.committed.update({int(n): server_round for n in contributors})
            self._rounds_applied += 1
        else:  # every client's work was dropped (stragglers under FedAvg): keep the arrays
            state = replace_state(state, server_round=server_round)
        self._round_state = state
        return to_array_record(state.adapter)

    def reset_run(self) -> None:
        """Count a new run's rounds (``start``); acceptances stay, as the global state does."""
        self._rounds_sent = self._rounds_applied = 0
        self._last_refusals = {}

    def check_applied(
        self, refusals: Mapping[int, str] | None = None, failure: str | None = None
    ) -> None:
        """Raise :class:`NoReplyAccepted` when train messages went out but no round applied
        one accepted update (the run's model is its initial one), naming the latest round's
        ``failure`` (a wrapper's reason) and refusals (``refusals``, else those this saw)."""
        if self._rounds_sent and not self._rounds_applied:
            last = self._last_refusals if refusals is None else refusals
            reasons = [f"node {n}: {r}" for n, r in sorted(last.items())]
            why = "; ".join([failure, *reasons] if failure else reasons)
            raise NoReplyAccepted(
                f"{type(self).__name__}: none of the {self._rounds_sent} training rounds "
                f"accepted a reply, so the model is the initial one. Last round: {why or 'no replies'}"
            )

    def check_run(self) -> None:
        """The run's end (:class:`CheckedStart`): :meth:`check_applied` on what this saw."""
        self.check_applied()

    def _train_metrics(self, contents: list[RecordDict]) -> MetricRecord | None:
        """Flower's metric aggregation over the replies that report ``weighted_by_key``."""
        usable = [
            c
            for c in contents
            if len(c.metric_records) == 1
            and self.weighted_by_key in next(iter(c.metric_records.values()))
        ]
        return self.train_metrics_aggr_fn(usable, self.weighted_by_key) if usable else None

    # ------------------------------------------------------------ client side
    def client_hook(
        self,
        config: Mapping[str, ConfigValue],
        global_adapter: Mapping[str, torch.Tensor],
        payload: Arrays,
        state: ClientStateStore,
    ) -> ClientHook:
        """Return the hook the trainer calls for one client in one round (default: no-op)."""
        return ClientHook()


class UniformWeighting(Strategy):
    """Wrap a strategy so every client weighs 1: what DP needs to bound one client's influence.

    Everything else delegates to the inner strategy, so any strategy can be wrapped.
    """

    def __init__(self, inner: Strategy) -> None:
        super().__init__(
            server_lr=inner.server_lr,
            weighting="uniform",
            server_optimizer=inner.optimizer.cfg,
            robust=inner.robust,
            population=inner.population,
            **inner.flower_options,
        )
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.accepts_partial_work = inner.accepts_partial_work  # type: ignore[misc]
        self.local_optimizer = inner.local_optimizer  # type: ignore[misc]

    def init_extras(self, adapter: Arrays) -> Arrays:
        """Delegate to the inner strategy."""
        return self.inner.init_extras(adapter)

    def client_config(self, server_round: int) -> dict[str, ConfigValue]:
        """The inner strategy's config with ``weighting = uniform``."""
        return {**self.inner.client_config(server_round), keys.CFG_WEIGHTING: "uniform"}

    def client_payload(self, state: GlobalState) -> Arrays:
        """Delegate to the inner strategy."""
        return self.inner.client_payload(state)

    def contribution_spec(self, state: GlobalState) -> dict[str, tuple[int, ...]]:
        """Delegate to the inner strategy."""
        return self.inner.contribution_spec(state)

    def finalize(self, state: GlobalState, summed: Arrays, population: int) -> GlobalState:
        """Delegate to the inner strategy."""
        return self.inner.finalize(state, summed, population)

    def combine(self, contributions: list[Arrays]) -> tuple[Arrays, list[int]]:
        """Delegate to the inner strategy."""
        return self.inner.combine(contributions)

    def client_hook(
        self,
        config: Mapping[str, ConfigValue],
        global_adapter: Mapping[str, torch.Tensor],
        payload: Arrays,
        state: ClientStateStore,
    ) -> ClientHook:
        """Delegate to the inner strategy."""
        return self.inner.client_hook(config, global_adapter, payload, state)
