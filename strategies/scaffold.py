"""SCAFFOLD (Karimireddy et al. 2020, https://arxiv.org/abs/1910.06378), option II control variates.

Notation of the paper: global model x, server control c, client control c_i,
K local steps of size eta_l, S the sampled clients of N in total, global step eta_g.

Client i (:class:`ScaffoldHook`):
    every local step   y <- y - eta_l (g_i(y) + c - c_i)   (gradient corrected by c - c_i)
    after K steps      c_i+ = c_i - c + (x - y) / (K eta_l)            (option II)
    sends              delta = y - x  and  ctrl = c_i+ - c_i;  keeps c_i+ for next time
Server (:meth:`Scaffold.finalize`):
    x <- x + eta_g * weighted mean of the deltas
    c <- c + |S|/N * mean over S of ctrl  =  c + sum(ctrl) / N

c travels to clients in the ``strategy`` record under ``ctrl/<tensor>`` keys; the
control deltas come back in the same contribution as the adapter delta (``ctrl/``
keys), so SecAgg sums both and a DP mechanism's clipping bound covers both.
The option II formula assumes plain SGD steps; with an adaptive optimizer the
control variate is an estimate only (use ``optimizer = "sgd"`` for the paper's setting).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fedge import keys
from fedge.strategies.base import (
    Arrays,
    ClientHook,
    ClientStateStore,
    ConfigValue,
    GlobalState,
    Strategy,
    sum_contributions,
)
from fedge.strategies.robust import krum_select

if TYPE_CHECKING:
    import torch

COORDINATEWISE_RULES = ("median", "trimmed-mean")  # no client's update survives whole


def control_update(c_i: Arrays, c: Arrays, delta: Arrays, local_steps: int, lr: float) -> Arrays:
    """Return option II's new client control c_i+ = c_i - c - delta / (K eta_l), delta = y - x."""
    if local_steps <= 0 or lr <= 0:
        raise ValueError(f"SCAFFOLD needs local_steps > 0 and lr > 0, got {local_steps} and {lr}")
    scale = 1.0 / (local_steps * lr)
    return {k: (c_i[k] - c[k] - delta[k] * scale).astype(np.float32) for k in delta}


class ScaffoldHook(ClientHook):
    """Corrects each local gradient by c - c_i and computes the control delta at the end."""

    def __init__(self, c: Arrays, c_i: Arrays, device: torch.device | None = None) -> None:
        import torch  # the client's training only: loading the strategy never imports torch

        self.c = c
        self.c_i = c_i
        self._correction = {
            k: torch.from_numpy(c[k] - c_i[k]).to(device or "cpu") for k in c
        }  # c - c_i per adapter tensor, same shapes as the tensors

    def correct_gradients(self, trainable: Mapping[str, torch.Tensor]) -> None:
        """Add c - c_i to each trainable tensor's gradient."""
        for name, w in trainable.items():
            if w.grad is not None:
                w.grad.add_(self._correction[name].to(w.grad.device, w.grad.dtype))

    def finish(self, delta: Arrays, local_steps: int, lr: float) -> tuple[Arrays, Arrays | None]:
        """Return ``ctrl/`` deltas to contribute and c_i+ to keep."""
        c_new = control_update(self.c_i, self.c, delta, local_steps, lr)
        extras = {keys.PREFIX_CONTROL + k: c_new[k] - self.c_i[k] for k in c_new}
        return extras, c_new


class Scaffold(Strategy):
    """SCAFFOLD's server: a global learning rate on x, and c moved by |S|/N of the mean control delta."""

    name = "scaffold"
    accepts_partial_work = False
    local_optimizer = "sgd"  # the paper's local update; its control variates assume plain SGD steps

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As :class:`Strategy`; a coordinate-wise robust rule is refused (see :meth:`combine`)."""
        super().__init__(*args, **kwargs)
        if self.robust.rule in COORDINATEWISE_RULES:
            raise ValueError(
                f"SCAFFOLD with the {self.robust.rule!r} rule is refused: a coordinate-wise rule "
                "keeps no client's control delta whole, so no client could know which c_i the "
                "server's c holds and c = mean(c_i), what SCAFFOLD's correction needs, would "
                "break; use 'krum' (SCAFFOLD over the client Krum selects) or 'mean' with "
                "max_update_norm"
            )

    def combine(self, contributions: list[Arrays]) -> tuple[Arrays, list[int]]:
        """Under Krum, SCAFFOLD over the one client Krum selects: x moves by its update (as
        FedAvg + Krum), c by its control delta / N, and only its c_i commits, so c = mean(c_i)
        holds; other rules as :class:`Strategy` (every accepted update, every c_i commits)."""
        if self.robust.rule != "krum":
            return super().combine(contributions)
        live = [
            i
            for i, c in enumerate(contributions)
            if float(c[keys.KEY_COUNT][0]) > 0 and float(c[keys.KEY_WEIGHT][0]) > 0
        ]
        if not live:  # every client's work was dropped: the plain sum says so (weight 0)
            return sum_contributions(contributions), []
        chosen = live[krum_select([contributions[i] for i in live], self.robust.krum_malicious)]
        update, n = contributions[chosen], float(len(live))
        scale = n / float(update[keys.KEY_WEIGHT][0])  # n times its unscaled update, weight n
        summed: Arrays = {
            k: (v.astype(np.float64) * scale).astype(np.float32)
            if k.startswith(keys.PREFIX_DELTA)
            else v.astype(np.float32)  # ctrl/: the selected client's control delta, once
            for k, v in update.items()
            if not k.startswith(keys.PREFIX_META)
        }
        summed[keys.KEY_WEIGHT] = np.array([n], np.float32)
        summed[keys.KEY_COUNT] = np.array([n], np.float32)
        return summed, [chosen]

    def init_extras(self, adapter: Arrays) -> Arrays:
        """c starts at zero for every adapter tensor (beside the server optimizer's state)."""
        return {
            **super().init_extras(adapter),
            **{
                keys.PREFIX_CONTROL + k: np.zeros_like(v, dtype=np.float32)
                for k, v in adapter.items()
            },
        }

    def client_payload(self, state: GlobalState) -> Arrays:
        """Send c beside the adapter."""
        return {k: v for k, v in state.extras.items() if k.startswith(keys.PREFIX_CONTROL)}

    def contribution_spec(self, state: GlobalState) -> dict[str, tuple[int, ...]]:
        """The adapter delta, the weight and count, plus one ``ctrl/`` key per adapter tensor."""
        spec = super().contribution_spec(state)
        spec.update({keys.PREFIX_CONTROL + k: v.shape for k, v in state.adapter.items()})
        return spec

    def finalize(self, state: GlobalState, summed: Arrays, population: int) -> GlobalState:
        """Update x as FedAvg does (times server_lr) and c += sum(ctrl) / N."""
        if population <= 0:
            raise ValueError(f"SCAFFOLD needs the client population N > 0, got {population}")
        moved = super().finalize(state, summed, population)
        extras = dict(moved.extras)
        extras.update(
            {
                k: (v + summed[k] / population).astype(np.float32)
                for k, v in state.extras.items()
                if k.startswith(keys.PREFIX_CONTROL)
            }
        )
        return GlobalState(moved.adapter, extras, moved.server_round)

    def client_hook(
        self,
        config: Mapping[str, ConfigValue],
        global_adapter: Mapping[str, torch.Tensor],
        payload: Arrays,
        state: ClientStateStore,
    ) -> ClientHook:
        """Return the correction hook with c from the payload and c_i from the client's store."""
        server_round = int(config.get(keys.CFG_SERVER_ROUND, 1))
        c = {k: np.asarray(payload[keys.PREFIX_CONTROL + k], np.float32) for k in global_adapter}
        saved = state.load(server_round)
        c_i = saved if saved is not None else {k: np.zeros_like(v) for k, v in c.items()}
        device = next(iter(global_adapter.values())).device
        return ScaffoldHook(c, c_i, device)
