"""Cohort sampling the accountant can trust: the draw's law, its secrecy, and its accounting."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.privacy.accounting import gaussian_epsilon
from fedge.server.sampling import (
    Draw,
    SampledDPBudget,
    draw_cohort,
    sampled_epsilon,
    sampling_scheme,
)

CANDIDATES = list(range(100, 140))  # 40 eligible nodes


def test_fixed_draws_exactly_k_uniformly_and_poisson_each_with_rate_q() -> None:
    """2,000 draws of K = 10 from 40: every node is in 1/4 of the cohorts (sd 0.0097 per node,
    tolerance 5 sd); fixed cohorts have exactly 10 members, Poisson cohorts vary around 10."""
    rng = np.random.default_rng(0)
    for scheme in ("fixed", "poisson"):
        counts = np.zeros(len(CANDIDATES))
        sizes = []
        for _ in range(2000):
            draw = draw_cohort(scheme, CANDIDATES, 10, rng)
            assert set(draw.sampled) <= set(CANDIDATES) and draw.rate == 0.25
            counts[[c - 100 for c in draw.sampled]] += 1
            sizes.append(len(draw.sampled))
        assert np.abs(counts / 2000 - 0.25).max() < 5 * np.sqrt(0.25 * 0.75 / 2000)
        if scheme == "fixed":
            assert set(sizes) == {10}
        else:
            assert abs(np.mean(sizes) - 10) < 0.3 and np.std(sizes) > 1.5  # binomial sd 2.7


def test_the_draw_is_secret_not_the_run_seed() -> None:
    """Without an explicit generator the coin is the OS's: two draws differ (same 'seed' state)."""
    np.random.seed(0)
    first = draw_cohort("fixed", CANDIDATES, 10).sampled
    np.random.seed(0)
    assert draw_cohort("fixed", CANDIDATES, 10).sampled != first


def test_sampled_epsilon_matches_the_unamplified_release_at_rate_one_and_amplifies_below() -> None:
    """q = 1 is a plain Gaussian release (fedge's unamplified accountant, RDP and PLD); fixed
    size with everyone in is a replace-one release, noise multiplier z / 2. At q = 0.1 the
    20 releases cost a fraction of that."""
    z, delta = 1.0, 1e-3
    for method in ("rdp", "pld"):
        full = gaussian_epsilon([z] * 20, delta, method)  # type: ignore[arg-type]
        assert sampled_epsilon("poisson", [(50, 50)] * 20, z, delta, method) == pytest.approx(full)
        assert sampled_epsilon("poisson", [(500, 50)] * 20, z, delta, method) < full / 4
    half = gaussian_epsilon([z / 2] * 20, delta, "rdp")
    assert sampled_epsilon("fixed", [(50, 50)] * 20, z, delta, "rdp") == pytest.approx(half)
    assert sampled_epsilon("fixed", [(500, 50)] * 20, z, delta, "rdp") < half / 2


def test_the_budget_accounts_each_draw_stops_before_overspending_and_checkpoints() -> None:
    budget = SampledDPBudget(1.0, 1e-3, "rdp", max_epsilon=2.0, scheme="poisson")
    draw = Draw("poisson", 1000, 100, ())
    releases = 0
    while budget.allows_draw(draw):
        budget.record_draw(releases + 1, draw)
        releases += 1
    assert releases > 1
    more = sampled_epsilon("poisson", [(1000, 100)] * (releases + 1), 1.0, 1e-3, "rdp")
    assert budget.epsilon() <= 2.0 < more
    restored = SampledDPBudget(1.0, 1e-3, "rdp", max_epsilon=2.0, scheme="poisson")
    restored.load_state(budget.state())
    assert restored.epsilon() == budget.epsilon()


def test_bad_sampling_settings_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="privacy-sampling='bernoulli'"):
        sampling_scheme({"privacy-sampling": "bernoulli"}, 0.0)
    with pytest.raises(ValueError, match="over-selection = 0"):
        sampling_scheme({"privacy-sampling": "poisson"}, 0.3)
    with pytest.raises(ValueError, match="RDP only"):
        SampledDPBudget(1.0, 1e-3, "pld", 0.0, "fixed")
