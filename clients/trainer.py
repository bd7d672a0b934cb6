"""The local trainer: a few optimizer steps on a client's tokens with the strategy's hooks.

Read top to bottom: config, batches, optimizer factory, the step loop, evaluation.
The loop is model-agnostic (it takes a ``batch_loss(step)`` callable and the
trainable tensors by name), so the LoRA ClientApp and the synthetic behaviour tests
run the same code. The optimizer is built in ONE place, :func:`build_optimizer`,
selected by the ``optimizer`` config key, so DP-SGD (Opacus) can replace it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import numpy as np
import torch

from fedge.lm.bos import cut_windows
from fedge.lm.config import TrainConfig
from fedge.lm.evaluate import MIN_WINDOW
from fedge.strategies.base import ClientHook


# ---------------------------------------------------------------- batches
def random_windows(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    rng: np.random.Generator,
    bos: int | None = None,
) -> torch.Tensor:
    """Return a (batch_size, L + 1) LongTensor of random windows, L = seq_len or less for short data.

    With ``bos`` (the tokenizer adds BOS, `fedge.lm.bos`) each window is BOS + L stream tokens.
    """
    length = min(seq_len, len(tokens) - 2)
    if length < MIN_WINDOW:
        raise ValueError(
            f"a token stream of {len(tokens)} tokens is too short to train on "
            f"(need at least {MIN_WINDOW + 2}); give the client more data"
        )
    starts = rng.integers(0, len(tokens) - length - 1, size=batch_size)
    return torch.from_numpy(cut_windows(tokens, starts, length, bos))


# ---------------------------------------------------------------- optimizer (swappable)
def resolve_optimizer(cfg: TrainConfig, strategy_default: str) -> str:
    """The optimizer to build: ``optimizer``, or the strategy's own when it is "auto"."""
    return strategy_default if cfg.optimizer == "auto" else cfg.optimizer


def build_optimizer(
    model: torch.nn.Module, params: list[torch.nn.Parameter], cfg: TrainConfig, name: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Return (model, optimizer) for the trainable params; the ONE place DP-SGD replaces.

    ``name`` is "adamw" or "sgd" (``TrainConfig`` refuses anything else): a client never
    imports an optimizer a message names.
    """
    if name == "sgd":
        return model, torch.optim.SGD(params, lr=cfg.lr)
    return model, torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)


# ---------------------------------------------------------------- the local loop
def run_local_steps(
    trainable: Mapping[str, torch.Tensor],
    batch_loss: Callable[[int], torch.Tensor],
    steps: int,
    optimizer: torch.optim.Optimizer,
    hook: ClientHook,
    max_grad_norm: float = 0.0,
    autocast: contextlib.AbstractContextManager[None] | None = None,
) -> list[float]:
    """Run ``steps`` optimizer steps; return the data loss of each step.

    Per step: loss (+ strategy regularizer), backward, clip the raw gradient,
    strategy gradient correction, optimizer step.
    """
    params = list(trainable.values())
    losses: list[float] = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = batch_loss(step)
        reg = hook.regularizer(trainable)
        (loss.float() + reg if reg is not None else loss.float()).backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        hook.correct_gradients(trainable)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
