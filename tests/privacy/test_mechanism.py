"""Gaussian mechanism, distributed noise split and RDP accounting against dp-accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant as LibraryRdp
from scipy import stats

from fedge.privacy.mechanism import add_gaussian_noise, clip_contribution, sensitive_norm
from fedge.server.aggregation import PlainAggregator
from fedge.server.config import RunConfig
from fedge.server.privacy.accountant import DPBudget
from fedge.server.privacy.config import DPConfig
from fedge.server.privacy.factories import central_dp, default_budget


def contribution(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    """A SCAFFOLD-shaped contribution: two sensitive arrays, two public ones."""
    return {
        "delta/a.lora_B": rng.normal(0, scale, size=(30, 8)).astype(np.float32),
        "ctrl/a.lora_B": rng.normal(0, scale, size=(30, 8)).astype(np.float32),
        "meta/weight": np.array([1.0], dtype=np.float32),
        "meta/count": np.array([1.0], dtype=np.float32),
    }


@pytest.mark.parametrize("scale", [1e-3, 0.05, 3.0])
def test_clipping_bounds_the_joint_sensitive_norm(scale: float) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    c = contribution(rng, scale)
    before = sensitive_norm(c)
    # Execute
    clipped, norm = clip_contribution(c, clip_norm=1.0)
    # Assert: norm <= C (float32 slack), untouched below C, direction kept, meta untouched
    assert norm == pytest.approx(before)
    assert sensitive_norm(clipped) <= 1.0 + 1e-5
    factor = min(1.0, 1.0 / before)
    for k in ("delta/a.lora_B", "ctrl/a.lora_B"):
        np.testing.assert_allclose(clipped[k], c[k] * factor, rtol=1e-5, atol=1e-8)
        assert clipped[k].dtype == np.float32
    assert clipped["meta/weight"] is c["meta/weight"]


def test_noise_std_passes_a_chi_square_test() -> None:
    # Prepare: noise added to a zero sum, z C = 0.7
    zero = {"delta/x": np.zeros((400, 250), np.float32), "meta/count": np.array([3.0], np.float32)}
    std = 0.7
    # Execute
    noised = add_gaussian_noise(zero, std)
    # Assert: sample variance inside the two-sided 99.9% chi-square interval, mean ~ 0
    x = noised["delta/x"].astype(np.float64).reshape(-1)
    n = x.size
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], df=n - 1)
    assert lo <= (n - 1) * x.var(ddof=1) / std**2 <= hi
    assert abs(x.mean()) < 4 * std / math.sqrt(n)
    assert noised["meta/count"][0] == 3.0  # public keys get no noise
    skipped = add_gaussian_noise(zero, std, skip=frozenset({"delta/x"}))
    assert not np.any(skipped["delta/x"])  # FFA-LoRA's frozen keys get none either


def test_distributed_noise_shares_sum_to_at_least_the_central_noise() -> None:
    # Prepare: 10 sampled, at least 8 must survive; each client adds z C / sqrt(8)
    cfg = DPConfig(mode="distributed", clip_norm=0.5, noise_multiplier=1.2, min_survival=0.8)
    per_client = cfg.client_noise_std(10)
    zero = {"delta/x": np.zeros(200_000, np.float32)}
    # Execute: the sum of the 8 survivors' noise shares
    total = sum(
        add_gaussian_noise(zero, per_client)["delta/x"].astype(np.float64) for _ in range(8)
    )
    # Assert: its std is z C (chi-square on the variance)
    target = cfg.noise_multiplier * cfg.clip_norm
    n = total.size
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], df=n - 1)
    assert lo <= (n - 1) * total.var(ddof=1) / target**2 <= hi
    assert cfg.min_clients(10) == 8


def library_epsilon(event: dp_event.DpEvent, rounds: int, delta: float) -> float:
    """Epsilon of `rounds` compositions of `event` straight from dp-accounting's RDP."""
    acc = LibraryRdp()
    acc.compose(event, rounds)
    return float(acc.get_epsilon(delta))


def test_epsilon_matches_dp_accounting_without_amplification() -> None:
    # Prepare
    budget = DPBudget(DPConfig(noise_multiplier=1.1, target_delta=1e-5))
    # Execute
    for r in range(1, 6):
        budget.record(r, num_sampled=4, population=4)
    # Assert
    want = library_epsilon(dp_event.GaussianDpEvent(1.1), 5, 1e-5)
    assert budget.epsilon() == pytest.approx(want, rel=1e-9)


def test_pld_is_tighter_than_rdp_and_matches_the_library() -> None:
    # Prepare: z = 1, 10 full-participation rounds, delta 1e-5
    rdp = DPBudget(DPConfig(noise_multiplier=1.0, accountant="rdp"))
    pld = DPBudget(DPConfig(noise_multiplier=1.0, accountant="pld"))
    # Execute
    for r in range(1, 11):
        rdp.record(r, 4, 4)
        pld.record(r, 4, 4)
    # Assert: RDP 19.05 as the library computes it; PLD about 17.86, tighter
    assert rdp.epsilon() == pytest.approx(library_epsilon(dp_event.GaussianDpEvent(1.0), 10, 1e-5))
    assert pld.epsilon() == pytest.approx(17.86, abs=0.01)
    assert pld.epsilon() < rdp.epsilon()
    assert (rdp.method, pld.method) == ("rdp", "pld")


def test_the_same_seed_never_gives_the_same_noise() -> None:
    # Prepare: two "runs" that share everything a seed could fix
    zero = {"delta/x": np.zeros(1000, np.float32)}
    np.random.seed(0)
    first = add_gaussian_noise(zero, 1.0)["delta/x"]
    np.random.seed(0)
    second = add_gaussian_noise(zero, 1.0)["delta/x"]
    # Assert: independent draws (a replayable noise would be equal)
    assert not np.array_equal(first, second)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.15


def test_amplification_by_sampling_is_refused() -> None:
    # Prepare: a DP run that claims Poisson sampling the loop does not run
    cfg = RunConfig.from_mapping({"weighting": "uniform", "dp-sampling": "poisson"})
    # Execute / Assert
    with pytest.raises(ValueError, match="dp-sampling='poisson' is not supported"):
        central_dp(cfg)


def test_max_epsilon_without_any_dp_is_an_error() -> None:
    cfg = RunConfig.from_mapping({"max-epsilon": 5.0})
    with pytest.raises(ValueError, match=r"max-epsilon=5\.0 is set, but this run applies no"):
        default_budget(cfg, PlainAggregator())


def test_a_dp_aggregator_is_always_accounted() -> None:
    # Prepare: central DP with max-epsilon but no privacy-budget key
    cfg = RunConfig.from_mapping({"weighting": "uniform", "max-epsilon": 5.0})
    # Execute
    budget = default_budget(cfg, central_dp(cfg))
    # Assert: a real accountant that stops before 5.0
    assert isinstance(budget, DPBudget) and budget.cfg.max_epsilon == 5.0


def test_budget_refuses_the_release_that_would_overspend() -> None:
    # Prepare: epsilon after k rounds from the library; budget between rounds 3 and 4
    eps = [library_epsilon(dp_event.GaussianDpEvent(1.0), k, 1e-5) for k in (3, 4)]
    budget = DPBudget(DPConfig(noise_multiplier=1.0, max_epsilon=(eps[0] + eps[1]) / 2))
    # Execute
    allowed = []
    for r in range(1, 7):
        allowed.append(budget.allows(r))
        if allowed[-1]:
            budget.record(r, 3, 3)
    # Assert: three releases, then a stop; what was spent stays under the budget
    assert allowed == [True, True, True, False, False, False]
    assert budget.epsilon() == pytest.approx(eps[0])


def test_budget_state_round_trips_through_a_checkpoint() -> None:
    # Prepare
    a = DPBudget(DPConfig(noise_multiplier=0.8))
    for r in range(1, 4):
        a.record(r, 5, 20)
    # Execute
    b = DPBudget(DPConfig(noise_multiplier=0.8))
    b.load_state(a.state())
    # Assert
    assert b.epsilon() == pytest.approx(a.epsilon())
    assert a.epsilon() > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_norm": 0.0}, "clip_norm=0.0"),
        ({"noise_multiplier": -1.0}, "noise_multiplier=-1.0"),
        ({"target_delta": 1.0}, "target_delta=1.0"),
        ({"accountant": "prv"}, "accountant='prv'"),
        ({"mode": "local"}, "mode='local'"),
        ({"min_survival": 0.0}, "min_survival=0.0"),
    ],
)
def test_dp_config_rejects_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DPConfig(**kwargs)
