"""Acceptance rules of speculative decoding: which drafted tokens the target keeps, and the next one.

Pure functions on tensors (no I/O, no model): the verifier calls them on the
target's logits, the tests call them on hand-written distributions.

Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023, https://arxiv.org/abs/2211.17192), and Chen et al.,
"Accelerating Large Language Model Decoding with Speculative Sampling" (2023):
draft token x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i));
at the first rejection the next token is drawn from norm(max(0, p_i - q_i)); when
all k are accepted a bonus token is drawn from p_{k+1}. Every emitted token is
then distributed exactly as the target's p. The edge's duty: draw x_i from the
q_i it reports, and report q_i on its full support.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verification: `accepted` leading draft tokens, then `next_token`."""

    accepted: int
    next_token: int


def expected_tokens_per_pass(acceptance: float, draft_len: int) -> float:
    """Expected tokens one verify yields, (1 - a^(g+1)) / (1 - a), for i.i.d. acceptance a."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
    if draft_len < 0:
        raise ValueError(f"draft_len must be >= 0, got {draft_len}")
    if acceptance == 1.0:
        return float(draft_len + 1)
    return (1.0 - acceptance ** (draft_len + 1)) / (1.0 - acceptance)


def greedy_verdict(draft_ids: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """Accept draft tokens while they equal the target's argmax; next is the target's argmax.

    `target_logits` is [k+1, V]: row i scores the token after draft prefix i.
    """
    _check_rows(draft_ids, target_logits)
    return greedy_choices_verdict(draft_ids, target_logits.argmax(dim=-1).tolist())


def greedy_choices_verdict(draft_ids: Sequence[int], choices: Sequence[int]) -> Verdict:
    """`greedy_verdict` from the target's k+1 argmax choices (the verifier takes them batch-wide)."""
    if len(choices) != len(draft_ids) + 1:
        raise ValueError(f"need k+1 = {len(draft_ids) + 1} target choices, got {len(choices)}")
    accepted = 0
    for drafted, chosen in zip(draft_ids, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    return Verdict(accepted=accepted, next_token=int(choices[accepted]))


def sampling_verdict(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor,
    draft_dists: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Apply the Leviathan/Chen rule so the emitted tokens follow the target distribution.

    Parameters
    ----------
    draft_ids
        The k drafted token ids.
    draft_probs
        [k] q_i(draft_ids[i]), the draft's probability of each drafted token.
    draft_dists
        [k, V] the draft distributions q_i (rows sum to 1); used for the residual.
    target_probs
        [k+1, V] the target distributions p_i after each draft prefix (rows sum to 1).
    generator
        Random source; the verifier keeps one per session so runs are reproducible.
    """
    _check_rows(draft_ids, target_probs)
    k = len(draft_ids)
    if draft_probs.shape != (k,) or draft_dists.shape != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{k}] and draft_dists [{k}, {target_probs.shape[1]}], "
            f"got {tuple(draft_probs.shape)} and {tuple(draft_dists.shape)}"
        )
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
    for i, token in enumerate(draft_ids):
        p = float(target_probs[i, token])
        q = float(draft_probs[i])
        if q <= 0.0:
            raise ValueError(f"draft_probs[{i}] must be > 0 for the drafted token, got {q}")
        if float(uniforms[i]) < min(1.0, p / q):
            continue
        residual = torch.clamp(target_probs[i].double() - draft_dists[i].double(), min=0.0)
        return Verdict(accepted=i, next_token=_draw(residual, target_probs[i], generator))
    return Verdict(accepted=k, next_token=_draw(target_probs[k].double(), None, generator))


def _draw(
    weights: torch.Tensor, fallback: torch.Tensor | None, generator: torch.Generator | None
) -> int:
    """Sample an index proportional to `weights`; use `fallback` if they sum to zero (p == q)."""
    total = float(weights.sum())
    if total <= 0.0:
        if fallback is None:
            raise ValueError("cannot sample from an all-zero distribution")
        weights = fallback.double()
    return int(torch.multinomial(weights, 1, generator=generator).item())


def _check_rows(draft_ids: Sequence[int], target: torch.Tensor) -> None:
    """Target rows must be one more than the draft: one per draft prefix plus the bonus row."""
    if target.dim() != 2 or target.shape[0] != len(draft_ids) + 1:
        raise ValueError(
            f"target scores must be [k+1, V] = [{len(draft_ids) + 1}, V], got {tuple(target.shape)}"
        )
