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
"""

from __future__ import annotations

import dataclasses
from abc import ABC
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

import numpy as np
import torch

from fedge import keys
from fedge.types import Arrays, ConfigValue

Weighting = Literal["examples", "uniform"]


@dataclass(frozen=True)
class GlobalState:
    """What the server holds between rounds: the global adapter and the strategy's own arrays.

    ``adapter`` maps adapter tensor names (peft ``lora_`` names) to float32 arrays;
    ``extras`` holds strategy state under namespaced keys (SCAFFOLD: ``ctrl/<name>`` = c).
    """

    adapter: Arrays
    extras: Arrays = field(default_factory=dict)
    server_round: int = 0

    def __post_init__(self) -> None:
        """Refuse an empty adapter: there would be nothing to train or aggregate."""
        if not self.adapter:
            raise ValueError("GlobalState.adapter is empty: pass the adapter tensors to train")


@dataclass(frozen=True)
class ClientResult:
    """One client's local outcome, before it becomes a contribution.

    ``delta`` is local minus global for every adapter tensor; ``completed`` is the
    fraction of the configured local work the client finished (1.0 = all of it,
    less for a straggler); ``extras`` are the hook's namespaced arrays.
    """

    delta: Arrays
    num_examples: int
    completed: float = 1.0
    extras: Arrays = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Reject impossible counts and fractions early, naming the field."""
        if self.num_examples < 0:
            raise ValueError(f"ClientResult.num_examples must be >= 0, got {self.num_examples}")
        if not 0.0 <= self.completed <= 1.0:
            raise ValueError(f"ClientResult.completed must be in [0, 1], got {self.completed}")


class ClientStateStore(Protocol):
    """Where a client keeps strategy state across rounds (memory in Context.state, or disk).

    ``load`` returns the newest state saved for a round BEFORE ``server_round`` (so a
    replayed round after a resume sees exactly what it saw the first time), or None.
    """

    def load(self, server_round: int) -> Arrays | None:
        """Return the state saved by the latest round earlier than ``server_round``."""
        ...

    def save(self, server_round: int, arrays: Arrays) -> None:
        """Persist the state produced by ``server_round``."""
        ...


class ClientHook:
    """Client-side hooks of a strategy, called by the local trainer; the default does nothing.

    The trainer calls, in order: ``regularizer`` inside each step's loss,
    ``correct_gradients`` after ``backward`` and before the optimizer step, then once
    ``finish`` with the final delta. Tensors are keyed by adapter tensor name.
    """

    def regularizer(self, trainable: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Return an extra loss term (a scalar tensor) or None."""
        return None

    def correct_gradients(self, trainable: Mapping[str, torch.Tensor]) -> None:
        """Adjust ``.grad`` of the trainable tensors in place (default: leave them)."""

    def finish(self, delta: Arrays, local_steps: int, lr: float) -> tuple[Arrays, Arrays | None]:
        """Return (extra contribution arrays, client state to persist or None)."""
        return {}, None


class Strategy(ABC):
    """A federated optimisation algorithm as knobs, a client hook and a ``finalize`` step.

    Subclasses set ``name``, ``accepts_partial_work`` and ``local_optimizer`` and override
    what differs. ``server_lr`` scales the averaged delta (1.0 reproduces plain averaging).
    """

    name: ClassVar[str]
    accepts_partial_work: ClassVar[bool] = False
    local_optimizer: ClassVar[str] = "adamw"  # what `optimizer = "auto"` means on the client

    def __init__(self, server_lr: float = 1.0, weighting: Weighting = "examples") -> None:
        if server_lr <= 0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        if weighting not in ("examples", "uniform"):
            raise ValueError(f"weighting must be 'examples' or 'uniform', got {weighting!r}")
        self.server_lr = server_lr
        self.weighting: Weighting = weighting

    # ------------------------------------------------------------ server side
    def init_extras(self, adapter: Arrays) -> Arrays:
        """Return the strategy's initial server state for a fresh run (default: none)."""
        return {}

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
        """Apply one round's summed contributions: x <- x + server_lr * sum(w d) / sum(w)."""
        total_weight = float(summed[keys.KEY_WEIGHT][0])
        if total_weight <= 0:
            raise ValueError(
                f"round {state.server_round + 1}: the summed weight is {total_weight}; "
                "no client contributed, so there is nothing to average"
            )
        adapter = {
            k: (v + self.server_lr * summed[keys.PREFIX_DELTA + k] / total_weight).astype(
                np.float32
            )
            for k, v in state.adapter.items()
        }
        return GlobalState(adapter, dict(state.extras), state.server_round + 1)

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
        super().__init__(server_lr=inner.server_lr, weighting="uniform")
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.accepts_partial_work = inner.accepts_partial_work  # type: ignore[misc]

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

    def client_hook(
        self,
        config: Mapping[str, ConfigValue],
        global_adapter: Mapping[str, torch.Tensor],
        payload: Arrays,
        state: ClientStateStore,
    ) -> ClientHook:
        """Delegate to the inner strategy."""
        return self.inner.client_hook(config, global_adapter, payload, state)


def client_weight(result: ClientResult, weighting: Weighting) -> float:
    """Return the aggregation weight of one client: its example count, or 1."""
    return float(result.num_examples) if weighting == "examples" else 1.0


def build_contribution(result: ClientResult, weighting: Weighting, accept_partial: bool) -> Arrays:
    """Turn one client's result into its summable contribution (see the module docstring).

    A client that did only part of its work (``completed < 1``) under a strategy that
    refuses partial work contributes zeros with ``meta/count = 0``.
    """
    dropped = result.completed < 1.0 and not accept_partial
    weight = 0.0 if dropped else client_weight(result, weighting)
    out: Arrays = {
        keys.PREFIX_DELTA + k: (np.asarray(v, dtype=np.float32) * np.float32(weight))
        for k, v in result.delta.items()
    }
    for k, v in result.extras.items():
        arr = np.asarray(v, dtype=np.float32)
        out[k] = np.zeros_like(arr) if dropped else arr
    out[keys.KEY_WEIGHT] = np.array([weight], dtype=np.float32)
    out[keys.KEY_COUNT] = np.array([0.0 if dropped else 1.0], dtype=np.float32)
    return out


def sum_contributions(contributions: list[Arrays]) -> Arrays:
    """Element-wise sum of contributions with identical keys, in the given order (float64 accumulate)."""
    if not contributions:
        raise ValueError("sum_contributions got no contributions: at least one client must reply")
    first = contributions[0]
    acc = {k: np.asarray(v, dtype=np.float64).copy() for k, v in first.items()}
    for c in contributions[1:]:
        if c.keys() != first.keys():
            raise ValueError(
                f"contributions disagree on keys: {sorted(set(c) ^ set(first))[:5]}; "
                "validate replies before summing"
            )
        for k, v in c.items():
            acc[k] += v
    return {k: v.astype(np.float32) for k, v in acc.items()}


def replace_state(state: GlobalState, **changes: object) -> GlobalState:
    """Return a copy of ``state`` with fields replaced (a typed ``dataclasses.replace``)."""
    return dataclasses.replace(state, **changes)  # type: ignore[arg-type]
