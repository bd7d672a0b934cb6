"""FedAvg (McMahan et al. 2017, https://arxiv.org/abs/1602.05629): the weighted mean of client deltas.

Everything FedAvg needs is the default behaviour of :class:`fedge.strategies.base.Strategy`:
clients send ``weight * delta``, the server divides the sum by the summed weight.
A straggler's partial work is dropped (it contributes zeros and ``meta/count = 0``).
"""

from __future__ import annotations

from fedge.strategies.base import Strategy


class FedAvg(Strategy):
    """Federated averaging; weights are example counts unless ``weighting="uniform"``."""

    name = "fedavg"
    accepts_partial_work = False
