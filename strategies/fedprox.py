"""FedProx (Li et al. 2020, https://arxiv.org/abs/1812.06127): FedAvg plus a proximal term on clients.

Each client minimises ``f_i(w) + mu/2 * ||w - w_global||^2`` over the TRAINABLE
(adapter) tensors, and the server aggregates partial work from stragglers instead
of dropping it. With ``mu = 0`` and no stragglers FedProx is exactly FedAvg.
The config key is Flower's own (``proximal-mu``, as ``flwr.serverapp.strategy.FedProx``
sends it), so a client written for Flower's FedProx reads it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedge import keys
from fedge.strategies.base import (
    Arrays,
    ClientHook,
    ClientStateStore,
    ConfigValue,
    Strategy,
    Weighting,
)

if TYPE_CHECKING:
    import torch


def proximal_term(
    trainable: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float
) -> torch.Tensor:
    """Return mu/2 * sum_k ||w_k - anchor_k||^2 (a scalar on the tensors' device)."""
    import torch  # the client's training only: loading the strategy never imports torch

    total = torch.zeros((), device=next(iter(trainable.values())).device)
    for name, w in trainable.items():
        total = total + (w - anchor[name].to(w.device, w.dtype)).pow(2).sum()
    return 0.5 * mu * total


class ProximalHook(ClientHook):
    """Adds the proximal term towards the round's global adapter to every step's loss."""

    def __init__(self, global_adapter: Mapping[str, torch.Tensor], mu: float) -> None:
        self.anchor = {k: v.detach().clone() for k, v in global_adapter.items()}
        self.mu = mu

    def regularizer(self, trainable: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Return the proximal term, or None when mu is 0 (no extra work)."""
        if self.mu == 0.0:
            return None
        return proximal_term(trainable, self.anchor, self.mu)


class FedProx(Strategy):
    """FedAvg's aggregation, the proximal client hook, and partial work accepted."""

    name = "fedprox"
    accepts_partial_work = True

    def __init__(
        self,
        proximal_mu: float = 0.01,
        server_lr: float = 0.0,
        weighting: Weighting = "examples",
        **options: Any,
    ) -> None:
        super().__init__(server_lr=server_lr, weighting=weighting, **options)
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        self.proximal_mu = proximal_mu

    def client_config(self, server_round: int) -> dict[str, ConfigValue]:
        """FedAvg's keys plus ``proximal-mu``."""
        return {**super().client_config(server_round), keys.CFG_PROXIMAL_MU: self.proximal_mu}

    def client_hook(
        self,
        config: Mapping[str, ConfigValue],
        global_adapter: Mapping[str, torch.Tensor],
        payload: Arrays,
        state: ClientStateStore,
    ) -> ClientHook:
        """Return the proximal hook with mu from the message config."""
        mu = float(config.get(keys.CFG_PROXIMAL_MU, self.proximal_mu))
        return ProximalHook(global_adapter, mu)
