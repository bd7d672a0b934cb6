"""Model-card figures: held-out perplexity and the draft's greedy agreement with the target."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel


@torch.no_grad()
def perplexity(model: nn.Module, tokens: np.ndarray, context: int, windows: int) -> float:
    """exp(mean next-token loss) over the first `windows` non-overlapping held-out windows."""
    count = min(windows, (len(tokens) - 1) // context)
    if count == 0:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is shorter than one window")
    total, n = 0.0, 0
    for i in range(count):
        chunk = torch.from_numpy(tokens[i * context : (i + 1) * context + 1].astype(np.int64))
        logits = model(input_ids=chunk[None, :-1]).logits[0].float()
        total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        n += context
    return math.exp(total / n)


@dataclass(frozen=True)
class Agreement:
    """How often the draft's greedy token equals the target's along the target's greedy path."""

    rate: float  # fraction of positions where both greedy choices agree
    tokens_per_verify: (
        float  # mean tokens per target pass in greedy speculative decoding, draft length 4
    )
    positions: int


def prompts_from(tokens: np.ndarray, count: int, prompt_len: int) -> list[np.ndarray]:
    """`count` prompts spread evenly over a held-out stream."""
    stride = max(1, (len(tokens) - prompt_len) // max(1, count))
    return [tokens[i * stride : i * stride + prompt_len] for i in range(count)]


@torch.no_grad()
def greedy_agreement(
    target: PreTrainedModel,
    draft: nn.Module,
    prompts: list[np.ndarray],
    new_tokens: int,
    draft_length: int = 4,
) -> Agreement:
    """Teacher-forced agreement on the target's greedy continuation of each prompt.

    In greedy speculative decoding every accepted token equals the target's, so the run of
    agreements starting at a block's first position is exactly the number of drafts accepted.
    """
    agree_total, positions, tokens_emitted, passes = 0, 0, 0, 0
    for prompt in prompts:
        ids = torch.from_numpy(prompt.astype(np.int64))[None]
        path = target.generate(  # type: ignore[operator]  # transformers types generate loosely
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        target_choice = path[0, ids.size(1) :]
        draft_logits = draft(input_ids=path[:, :-1]).logits[0, ids.size(1) - 1 :]
        agree = (draft_logits.argmax(-1) == target_choice).tolist()
        agree_total += sum(agree)
        positions += len(agree)
        i = 0
        while i < len(agree):
            run = 0
            while run < draft_length and i + run < len(agree) and agree[i + run]:
                run += 1
            tokens_emitted += run + 1  # accepted drafts plus the target's own next token
            passes += 1
            i += run + 1
    return Agreement(
        rate=agree_total / positions,
        tokens_per_verify=tokens_emitted / passes,
        positions=positions,
    )
