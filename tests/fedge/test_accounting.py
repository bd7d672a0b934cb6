"""The core's RDP epsilon equals dp-accounting's, so `pip install fedge` needs no dp-accounting."""

from __future__ import annotations

import sys

import dp_accounting
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from fedge.privacy.accounting import gaussian_epsilon, rdp_gaussian_epsilon

CASES = [
    [1.0],
    [0.5] * 3,
    [1.1] * 100,
    [0.3, 0.7, 2.0, 2.0, 5.0],
    [4.0] * 1000,
    [50.0],
]


def dp_accounting_rdp(zs: list[float], delta: float) -> float:
    accountant = RdpAccountant()
    for z in zs:
        accountant.compose(dp_accounting.GaussianDpEvent(z))
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize("zs", CASES)
@pytest.mark.parametrize("delta", [1e-8, 1e-5, 1e-2])
def test_rdp_equals_dp_accounting(zs: list[float], delta: float) -> None:
    """Closed-form RDP at dp-accounting's orders and conversion: the same epsilon (a wrong
    order list or the plain Mironov conversion: 4.73 -> 5.30 at z = 1, delta = 1e-5)."""
    want = dp_accounting_rdp(zs, delta)
    assert gaussian_epsilon(zs, delta, "rdp") == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_rdp_edges() -> None:
    assert gaussian_epsilon([], 1e-5, "rdp") == 0.0
    assert rdp_gaussian_epsilon([0.0], 1e-5) == float("inf")
    assert rdp_gaussian_epsilon([1.0], 0.0) == float("inf")
    with pytest.raises(ValueError):
        rdp_gaussian_epsilon([-1.0], 1e-5)


def test_pld_without_dp_accounting_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """A core install asking for PLD is told which extra brings it; RDP still works."""
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ModuleNotFoundError, match=r"fedge\[dp\]"):
        gaussian_epsilon([1.0], 1e-5, "pld")
    assert gaussian_epsilon([1.0], 1e-5, "rdp") > 0
