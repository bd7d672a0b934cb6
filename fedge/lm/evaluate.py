"""Held-out evaluation of a causal LM: evenly spaced windows, next-token loss, bf16 autocast."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from fedge.lm.bos import cut_windows
from fedge.lm.config import TrainConfig

IGNORE_INDEX = -100  # a target position that is not scored
MIN_WINDOW = 8  # shortest usable window: below this a client has too little text to learn from


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 autocast speeds `device` up: a CUDA GPU with bf16, or a CPU with AVX-512
    BF16 or AMX. On an AVX2-only CPU it emulates bf16: a training step ran 9-12x slower than
    fp32 (fedge's demo and micro targets, 8 x 128 tokens)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def autocast_context(
    device: torch.device, precision: str
) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast when asked for ("bf16", or "auto" where the device runs it fast), else a
    no-op context (fp32)."""
    if precision == "bf16" or (precision == "auto" and bf16_is_fast(device)):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def eval_windows(
    tokens: np.ndarray, seq_len: int, max_windows: int, bos: int | None = None
) -> Iterator[torch.Tensor]:
    """Yield up to ``max_windows`` evenly spaced, non-overlapping (1, L + 1) windows, L <= seq_len.

    With ``bos`` each window is BOS + L stream tokens (`fedge.lm.bos`): BOS is never scored.
    """
    length = min(seq_len, len(tokens) - 1)
    if length < 1:
        raise ValueError(f"a held-out stream of {len(tokens)} tokens has nothing to score")
    n_full = (len(tokens) - 1) // length
    picks = np.unique(np.linspace(0, n_full - 1, num=min(n_full, max_windows)).astype(int))
    for i in picks:
        start = int(i) * length
        yield torch.from_numpy(cut_windows(tokens, [start], length, bos))


def split_window(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [:, :-1] and targets [:, 1:] of a (B, T+1) batch of token ids.

    A negative id ``~t`` is token ``t`` as input only (an instruction's prompt or padding,
    `fedge.data.instructions`): its target is IGNORE_INDEX, so it is never scored.
    """
    tokens = torch.where(batch < 0, torch.bitwise_not(batch), batch)
    targets = batch[:, 1:]
    return tokens[:, :-1], torch.where(targets < 0, IGNORE_INDEX, targets)


def lm_batch_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T+1) batch: inputs [:, :-1], targets [:, 1:].

    Over the scored targets only where the batch marks input-only tokens (`split_window`);
    0 (with a gradient) for a batch with no target at all.
    """
    if not bool((batch < 0).any()):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs).logits  # (B, T, V)
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
    inputs, targets = split_window(batch)
    logits = model(input_ids=inputs).logits
    total = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    return total / targets.ne(IGNORE_INDEX).sum().clamp(min=1)


@torch.no_grad()
def evaluate_tokens(
    model: torch.nn.Module,
    tokens: np.ndarray,
    cfg: TrainConfig,
    device: torch.device,
    bos: int | None = None,
) -> tuple[float, int]:
    """Return (mean token loss, tokens scored) on evenly spaced held-out windows (BOS first
    with ``bos``)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with autocast_context(device, cfg.precision):
        for window in eval_windows(tokens, cfg.seq_len, cfg.eval_batches, bos):
            w = window.to(device)
            n = int((w[:, 1:] >= 0).sum())  # scored targets (input-only tokens are negative)
            if n == 0:
                continue
            loss = lm_batch_loss(model, w)
            total += float(loss) * n
            count += n
    model.train(was_training)
    if count == 0:
        raise ValueError("the held-out windows hold no target token to score")
    return total / count, count
