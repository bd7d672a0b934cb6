"""End to end: speculative sampling through the engine reproduces the target's distribution."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy.stats import chisquare

from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig, VerifierEngine

VOCAB = 8
PROMPT = [3, 5]
TEMPERATURE = 1.0


def exact_joint(target: torch.nn.Module) -> np.ndarray:
    """P(x1, x2 | prompt) under the target at TEMPERATURE, enumerated over the vocabulary."""
    with torch.no_grad():
        first = torch.softmax(
            target(input_ids=torch.tensor([PROMPT])).logits[0, -1] / TEMPERATURE, -1
        )
        follow = torch.stack(
            [
                torch.softmax(
                    target(input_ids=torch.tensor([[*PROMPT, x]])).logits[0, -1] / TEMPERATURE, -1
                )
                for x in range(VOCAB)
            ]
        )
    return (first[:, None] * follow).double().numpy()


def test_two_token_samples_follow_the_target_joint_distribution(
    make_tiny_llama: Callable[..., torch.nn.Module],
) -> None:
    """600 two-token generations; chi-square on the 64-cell joint (cells pooled to expected >= 5).

    The draft (a different random model, top-4 truncated) disagrees with the target often, so
    both the acceptance and the residual branch are exercised; the draft's own joint
    distribution fails the same test (asserted), so the test can tell the two apart.
    """
    # Prepare
    target = make_tiny_llama(VOCAB, 2, 32, seed=11)
    draft = make_tiny_llama(VOCAB, 1, 32, seed=22)
    engine = VerifierEngine(target, EngineConfig(batch_window_s=0.0, torch_threads=1)).start()
    runtime = TorchDraftRuntime(draft)
    samples = 600
    counts = np.zeros((VOCAB, VOCAB))
    rejected = 0
    try:
        for seed in range(1, samples + 1):
            config = DecodeConfig(
                max_new_tokens=2, temperature=TEMPERATURE, seed=seed, draft_len=1, draft_top_k=4
            )
            decoder = SpeculativeDecoder(runtime, engine, config)
            # Execute
            first, second = decoder.generate(PROMPT)
            counts[first, second] += 1
            rejected += decoder.stats.drafted - decoder.stats.accepted
    finally:
        engine.stop()
    # Assert
    expected = exact_joint(target)
    expected *= samples / expected.sum()
    draft_joint = exact_joint(draft)
    order = np.argsort(expected.ravel())
    observed, exp, alt = counts.ravel()[order], expected.ravel()[order], draft_joint.ravel()[order]
    cut = int(np.searchsorted(np.cumsum(exp), 5.0))  # pool the rarest cells into one of >= 5
    pooled = lambda v: np.concatenate([[v[: cut + 1].sum()], v[cut + 1 :]])  # noqa: E731
    assert rejected > 60  # the residual branch really ran
    assert chisquare(pooled(observed), pooled(exp)).pvalue > 1e-3
    alt_counts = pooled(alt) * samples / alt.sum()  # what the draft alone would produce
    assert chisquare(alt_counts, pooled(exp)).pvalue < 1e-6
