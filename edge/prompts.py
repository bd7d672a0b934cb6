"""Held-out prompts from the standard-library corpus, for export validation, the demo and benches."""

from __future__ import annotations

from typing import Any

from fedge.data.corpus import stdlib_sources
from fedge.lm.bos import bos_token_id, with_bos

CHARS_PER_LABEL = 20_000  # a slice of every package is plenty for a few dozen prompts


def heldout_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens spread over the held-out split (never trained on),
    each after BOS where the tokenizer adds BOS (`fedge.lm.bos`)."""
    return [prompt for prompt, _ in heldout_examples(tokenizer, count, length, 0)]


def heldout_examples(
    tokenizer: Any, count: int, length: int, continuation: int
) -> list[tuple[list[int], list[int]]]:
    """`heldout_prompts(tokenizer, count, length)`, each with the up to `continuation` tokens
    that follow it in the held-out text (its true continuation)."""
    if count < 1 or length < 1:
        raise ValueError(f"need count >= 1 and length >= 1, got count={count} length={length}")
    files = [f for f in stdlib_sources(max_chars_per_label=CHARS_PER_LABEL) if f.heldout]
    tokens: list[int] = []
    for source in files:
        tokens.extend(tokenizer.encode(source.text, add_special_tokens=False))
        if len(tokens) >= 4 * count * length:
            break
    if len(tokens) < count * length:
        raise ValueError(
            f"the held-out split has {len(tokens)} tokens, fewer than {count} prompts x {length}"
        )
    stride = (len(tokens) - length) // count
    bos = bos_token_id(tokenizer)
    return [
        (
            with_bos(tokens[i * stride : i * stride + length], bos),
            tokens[i * stride + length : i * stride + length + continuation],
        )
        for i in range(count)
    ]
