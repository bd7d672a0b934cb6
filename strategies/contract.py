"""The contribution contract's data types and pure functions, shared by every strategy.

A client's local outcome (:class:`ClientResult`) becomes ONE flat dict of float32
arrays, its *contribution* (keys in :mod:`fedge.keys`); the server only needs the
element-wise sum of the contributions (:func:`sum_contributions`). See
:mod:`fedge.strategies.base` for how the halves fit together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from fedge import keys
from fedge.types import Arrays

if TYPE_CHECKING:
    import torch

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
