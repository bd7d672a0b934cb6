"""The client half of fedge's strategies for ANY Flower ClientApp with its own torch loop.

A plain Flower ClientApp trains its model and replies with the new arrays. To run
under fedge's FedProx or SCAFFOLD (and any fedge strategy to come) it wraps its loop
with :class:`TrainRound`, three calls and nothing else::

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        fl = TrainRound.start(msg, context, model)   # loads the global arrays into model
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # SCAFFOLD assumes plain SGD
        for x, y in batches:
            optimizer.zero_grad()
            loss = criterion(model(x), y) + fl.loss_term()   # FedProx: mu/2 ||w - w_global||^2
            loss.backward()
            fl.correct_gradients()                           # SCAFFOLD: grad += c - c_i
            optimizer.step()
        return fl.reply(num_examples=len(train_set), local_steps=len(batches), lr=LR)

Under a fedge strategy the reply carries the strategy's summable ``contribution`` (keys
in :mod:`fedge.keys`); under one of Flower's own strategies (no ``strategy`` key in the
config) it is Flower's usual reply, the trained arrays plus ``num-examples``, and the
hooks do nothing. So the same ClientApp serves Flower's FedAvg, FedAdam, Krum, ... and
fedge's FedAvg, FedProx and SCAFFOLD: switching is a server-side change. Strategy state that outlives the round (SCAFFOLD's ``c_i``) is kept in the
node's ``Context.state`` by default, or in any :class:`~fedge.strategies.contract.ClientStateStore`
(``fedge.strategies.state.DiskStore`` on a shared directory for a Ray cluster), saved with
every reply as pending and used only once the server's next message says that reply is in
its aggregate (:func:`committed_round`), so SCAFFOLD's c = mean(c_i) survives refused, lost
and SecAgg+-dropped replies and Krum's unselected ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from fedge import keys
from fedge.strategies.arrays import array_numpy
from fedge.strategies.base import Strategy
from fedge.strategies.contract import ClientHook, ClientResult, ClientStateStore, build_contribution
from fedge.strategies.registry import build_strategy
from fedge.strategies.state import CommittedStore, ContextStore
from fedge.types import Arrays, ConfigValue

FLOWER_ARRAYS = "arrays"  # the record name Flower's strategies send the global arrays under


def message_config(msg: Message) -> dict[str, ConfigValue]:
    """The message's config record (fedge's and Flower's both call it ``config``)."""
    if keys.REC_CONFIG not in msg.content.config_records:
        raise ValueError(
            f"train message has no '{keys.REC_CONFIG}' ConfigRecord: send it with a fedge "
            "strategy (strategy.start) or fedge's ServerApp"
        )
    return dict(msg.content.config_records[keys.REC_CONFIG])  # type: ignore[arg-type]


def global_arrays(msg: Message) -> Arrays:
    """The global arrays of a train message: fedge's ``global`` record or Flower's ``arrays``."""
    for name in (keys.REC_GLOBAL, FLOWER_ARRAYS):
        if name in msg.content.array_records:
            rec = msg.content.array_records[name]
            return {k: np.asarray(array_numpy(v), dtype=np.float32) for k, v in rec.items()}
    raise ValueError(
        f"train message has neither a '{keys.REC_GLOBAL}' nor an '{FLOWER_ARRAYS}' ArrayRecord"
    )


def strategy_config(config: Mapping[str, ConfigValue]) -> dict[str, ConfigValue]:
    """The config to build the client half from; Flower's FedProx (``proximal-mu`` without a
    fedge ``strategy`` key) gets fedge's proximal term, Flower's other strategies plain FedAvg's."""
    if keys.CFG_STRATEGY not in config and keys.CFG_PROXIMAL_MU in config:
        return {**config, keys.CFG_STRATEGY: "fedprox"}
    return dict(config)


def committed_round(config: Mapping[str, ConfigValue], node_id: int) -> int | None:
    """The last round whose contribution from ``node_id`` the server's aggregate holds (0: none
    yet); None when the server sends no acceptances (Flower's own strategies).

    The client saves its new state (SCAFFOLD's c_i) with every reply, as pending; it loads only
    the state of this round, so a reply the server refused, lost or left out of its sum (a
    SecAgg+ drop-out, a client Krum did not select) never advances it.
    """
    nodes = config.get(keys.CFG_COMMITTED_NODES)
    rounds = config.get(keys.CFG_COMMITTED_NODE_ROUNDS)
    if not isinstance(nodes, list) or not isinstance(rounds, list) or len(nodes) != len(rounds):
        return None
    return int(dict(zip(nodes, rounds, strict=True)).get(node_id, 0))


class TrainRound:
    """One client round of a fedge strategy around the caller's own training loop.

    ``start`` loads the global arrays into ``model`` and builds the strategy's hook;
    the loop adds :meth:`loss_term` to its loss and calls :meth:`correct_gradients`
    after ``backward``; :meth:`reply` turns the trained model into the reply message.
    The strategy comes from the message's config (``strategy``, ``proximal-mu``, ...).
    """

    def __init__(self, msg: Message, model: torch.nn.Module, store: ClientStateStore) -> None:
        self.msg = msg
        self.model = model
        self.config = message_config(msg)
        committed = committed_round(self.config, msg.metadata.dst_node_id)
        self.store: ClientStateStore = (
            store if committed is None else CommittedStore(store, committed)
        )
        self.strategy: Strategy = build_strategy(strategy_config(self.config))
        self.server_round = int(self.config.get(keys.CFG_SERVER_ROUND, 1))  # type: ignore[call-overload]
        self.global_arrays = global_arrays(msg)
        state = model.state_dict()
        missing = sorted(set(state) ^ set(self.global_arrays))
        if missing:
            raise ValueError(
                f"the global arrays and the model's state_dict differ in {missing[:3]}: send "
                "ArrayRecord(model.state_dict()) of the same architecture as initial_arrays"
            )
        model.load_state_dict(
            {k: torch.from_numpy(v).to(state[k].dtype) for k, v in self.global_arrays.items()}
        )
        device = next(iter(state.values())).device
        anchor = {k: torch.from_numpy(v).to(device) for k, v in self.global_arrays.items()}
        self.trainable = {
            k: p for k, p in model.named_parameters() if p.requires_grad and k in anchor
        }
        payload = {
            k: array_numpy(v)
            for k, v in msg.content.array_records.get(keys.REC_STRATEGY, {}).items()
        }
        self.hook: ClientHook = self.strategy.client_hook(self.config, anchor, payload, self.store)

    @classmethod
    def start(
        cls,
        msg: Message,
        context: Context,
        model: torch.nn.Module,
        store: ClientStateStore | None = None,
    ) -> TrainRound:
        """Begin a round; strategy state goes to ``store`` or else the node's Context."""
        return cls(msg, model, store if store is not None else ContextStore(context.state))

    @property
    def optimizer_hint(self) -> str:
        """The local optimizer the strategy assumes: "sgd" for SCAFFOLD, "adamw" otherwise."""
        return self.strategy.local_optimizer

    def loss_term(self) -> torch.Tensor:
        """The strategy's extra loss (FedProx's proximal term), a zero scalar when it has none."""
        term = self.hook.regularizer(self.trainable)
        if term is None:
            device = next(iter(self.trainable.values())).device
            return torch.zeros((), device=device)
        return term

    def correct_gradients(self) -> None:
        """Edit the gradients after ``backward`` as the strategy needs (SCAFFOLD's c - c_i)."""
        self.hook.correct_gradients(self.trainable)

    def reply(
        self,
        num_examples: int,
        local_steps: int,
        lr: float,
        metrics: Mapping[str, float] | None = None,
        completed: float = 1.0,
    ) -> Message:
        """The train reply: the contribution of the trained model plus ``num-examples`` and metrics.

        ``local_steps`` and ``lr`` are the steps run and their step size (SCAFFOLD's
        control update divides by their product); ``completed`` < 1 marks partial work.
        """
        local = {
            k: v.detach().cpu().numpy().astype(np.float32)
            for k, v in self.model.state_dict().items()
        }
        delta = {k: local[k] - self.global_arrays[k] for k in self.global_arrays}
        extras, new_state = self.hook.finish(delta, local_steps, lr)
        reported = MetricRecord({keys.MET_NUM_EXAMPLES: num_examples, **(metrics or {})})
        if (
            keys.CFG_STRATEGY not in self.config
        ):  # a Flower strategy sent this: Flower's reply shape
            arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in local.items()})
            content = RecordDict({FLOWER_ARRAYS: arrays, keys.REC_METRICS: reported})
            return Message(content, reply_to=self.msg)
        contribution = build_contribution(
            ClientResult(delta, num_examples, completed, extras),
            self.strategy.weighting,
            bool(self.config.get(keys.CFG_ACCEPT_PARTIAL, self.strategy.accepts_partial_work)),
        )
        if new_state is not None and contribution[keys.KEY_COUNT][0] > 0:
            self.store.save(self.server_round, new_state)
        record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in contribution.items()})
        return Message(
            RecordDict({keys.REC_CONTRIB: record, keys.REC_METRICS: reported}), reply_to=self.msg
        )
