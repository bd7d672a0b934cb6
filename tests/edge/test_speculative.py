"""Acceptance rules: hand-derived greedy verdicts and the exactness of the sampling rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from fedge.edge.speculative import expected_tokens_per_pass, greedy_verdict, sampling_verdict


def one_hot_logits(choices: list[int], vocab: int = 6) -> torch.Tensor:
    """Logits whose argmax at row i is choices[i]."""
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("draft", "target_choices", "accepted", "next_token"),
    [
        ([2, 3, 4], [2, 3, 4, 5], 3, 5),  # all accepted: bonus token is row k's argmax
        ([2, 3, 4], [2, 1, 4, 5], 1, 1),  # first mismatch at 1: correction is the target's choice
        ([2, 3, 4], [0, 3, 4, 5], 0, 0),  # rejected at once
        ([], [4], 0, 4),  # empty draft: one plain target step
    ],
)
def test_greedy_verdict_accepts_the_matching_prefix(
    draft: list[int], target_choices: list[int], accepted: int, next_token: int
) -> None:
    # Execute
    verdict = greedy_verdict(draft, one_hot_logits(target_choices))
    # Assert
    assert (verdict.accepted, verdict.next_token) == (accepted, next_token)


def test_greedy_verdict_rejects_wrong_row_count() -> None:
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        greedy_verdict([1, 2], one_hot_logits([1, 2]))


def test_expected_tokens_per_pass_matches_the_geometric_sum() -> None:
    # a = 0.5, g = 3: 1 + 0.5 + 0.25 + 0.125 = 1.875
    assert expected_tokens_per_pass(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    with pytest.raises(ValueError, match=r"acceptance"):
        expected_tokens_per_pass(1.5, 2)


def test_sampling_accepts_everything_when_draft_equals_target() -> None:
    # Prepare: p == q, so min(1, p/q) = 1 for every drafted token
    p = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        # Execute
        verdict = sampling_verdict([1, 0], p[:2, [1, 0]].diagonal(), p[:2], p, generator)
        # Assert
        assert verdict.accepted == 2


def test_sampling_never_keeps_a_token_the_target_rules_out() -> None:
    # Prepare: p(1) = 0 at the first position, so the drafted 1 must be rejected and never emitted
    p = torch.tensor([[0.5, 0.0, 0.5], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.8, 0.1]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        verdict = sampling_verdict([1], q[:, 1], q, p, generator)
        assert verdict.accepted == 0 and verdict.next_token in (0, 2)


def test_sampling_rule_output_follows_the_target_distribution() -> None:
    """Chi-square test: first emitted token ~ p_1 when drafts are drawn from a different q_1.

    The emitted token is the draft x ~ q if accepted, else a draw from norm(max(0, p - q)).
    With 10,000 draws and 5 cells, a correct rule passes at the 0.1% level with probability
    0.999; the buggy variant below (no residual, resample from p) fails it by a wide margin.
    """
    # Prepare
    p = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10], dtype=torch.float64)
    q = torch.tensor([0.40, 0.10, 0.10, 0.30, 0.10], dtype=torch.float64)
    bonus = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    target = torch.stack([p, bonus])
    generator = torch.Generator().manual_seed(1234)
    rng = np.random.default_rng(1234)
    draws = 10_000
    counts = np.zeros(5)
    buggy = np.zeros(5)
    drafted = rng.choice(5, size=draws, p=q.numpy())
    for x in drafted:
        # Execute
        verdict = sampling_verdict([int(x)], q[[x]], q[None], target, generator)
        counts[int(x) if verdict.accepted else verdict.next_token] += 1
        wrong = sampling_verdict(
            [int(x)], q[[x]], torch.zeros(1, 5, dtype=torch.float64), target, generator
        )
        buggy[int(x) if wrong.accepted else wrong.next_token] += 1
    # Assert
    assert chisquare(counts, draws * p.numpy()).pvalue > 1e-3
    assert chisquare(buggy, draws * p.numpy()).pvalue < 1e-6


def test_sampling_bonus_token_follows_the_last_row() -> None:
    """All drafts accepted (p == q): the bonus token is drawn from p_{k+1}."""
    p1 = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    bonus = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    generator = torch.Generator().manual_seed(7)
    counts = np.zeros(3)
    for _ in range(3000):
        verdict = sampling_verdict([0], p1[[0]], p1[None], torch.stack([p1, bonus]), generator)
        assert verdict.accepted == 1
        counts[verdict.next_token] += 1
    assert chisquare(counts, 3000 * bonus.numpy()).pvalue > 1e-3
