"""Epsilon of composed Gaussian releases: RDP (the default), or dp-accounting's tighter PLD.

Both sides use it: the server's budget (one release per round) and a client's own
ledger of the rounds it contributed to. No amplification by sampling is claimed:
every release is a full Gaussian mechanism of noise multiplier z on a sum whose
per-client sensitivity (add or remove one client) is the clip norm C.

RDP is computed here in closed form (order a of a Gaussian release: a / (2 z^2), summed
over releases) at dp-accounting's default orders with its conversion to (epsilon, delta),
so the core install reports epsilon without dp-accounting (and its scipy); the result
equals dp-accounting's ``RdpAccountant`` (tests/fedge/test_accounting.py). PLD needs
dp-accounting: the ``dp`` extra.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Literal

Method = Literal["rdp", "pld"]
METHODS: tuple[Method, ...] = ("rdp", "pld")
# PLD grid step: dp-accounting's pessimistic discretization stays an upper bound; at 1e-2
# it matches 1e-4 to 1e-4 in epsilon for z in [0.3, 3] at a hundredth of the time.
PLD_INTERVAL = 1e-2
# dp-accounting's DEFAULT_RDP_ORDERS (rdp_privacy_accountant.py), so both give one epsilon
RDP_ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)),
    *range(11, 64),
    128,
    256,
    512,
    1024,
)


def check_method(method: str) -> Method:
    """Return ``method`` if it names an accountant, else raise naming the choices."""
    if method not in METHODS:
        raise ValueError(f"dp-accountant={method!r}: use one of {', '.join(METHODS)}")
    return method  # type: ignore[return-value]


def gaussian_epsilon(noise_multipliers: Sequence[float], delta: float, method: Method) -> float:
    """Epsilon at ``delta`` of one Gaussian release per entry (0.0 for no release)."""
    if not noise_multipliers:
        return 0.0
    if method == "rdp":
        return rdp_gaussian_epsilon(noise_multipliers, delta)
    # Imported here: dp-accounting pulls in scipy (seconds), and the Deployment Engine starts
    # a fresh ClientApp process for every message, most of which never compute an epsilon.
    try:
        import dp_accounting
        from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "the PLD accountant needs dp-accounting: pip install 'fedge[dp]' "
            "(or use the default accountant, rdp)",
            name=exc.name,
        ) from exc

    accountant = PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    for z, count in sorted(Counter(float(z) for z in noise_multipliers).items()):
        accountant.compose(dp_accounting.GaussianDpEvent(z), count)
    return float(accountant.get_epsilon(delta))


def rdp_gaussian_epsilon(noise_multipliers: Sequence[float], delta: float) -> float:
    """Epsilon at ``delta`` of one full Gaussian release per entry, by RDP.

    The releases' RDP at each order a is sum(a / (2 z^2)); the conversion is Proposition 12
    of Canonne, Kamath and Steinke (2020), as dp-accounting's ``compute_epsilon`` applies it,
    minimised over the orders.
    """
    if delta < 0:
        raise ValueError(f"delta must be non-negative, got {delta}")
    if any(z < 0 for z in noise_multipliers):
        raise ValueError(f"noise multipliers must be non-negative, got {noise_multipliers}")
    inv = sum(math.inf if z == 0 else 1.0 / (2.0 * z * z) for z in noise_multipliers)
    if delta == 0:
        return 0.0 if inv == 0 else math.inf
    best = math.inf
    for a in RDP_ORDERS:
        r = a * inv
        if delta**2 + math.expm1(-r) > 0:
            eps = 0.0  # delta <= sqrt(1 - exp(-KL)): no further bound needed
        elif a > 1.01:
            eps = r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1)
        else:
            eps = math.inf
        best = min(best, eps)
    return max(0.0, best)
