"""Pretraining and distillation loops for the zoo, resumable and deterministic.

One loop serves both stages: `loss_fn` is next-token cross-entropy for the target and
KL to the frozen target's distribution for the draft.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from fedge.lm.evaluate import bf16_is_fast
from fedge.zoo.presets import TrainBudget

ProgressFn = Callable[[int, int, float], None]  # (step, total_steps, loss)
LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainResult:
    """What a finished stage reports for the model card."""

    steps: int
    tokens: int
    seconds: float
    cpu_seconds: float  # process CPU time: on a quiet machine, wall time is about this / threads
    final_loss: float


def lr_at(step: int, budget: TrainBudget, time_used: float = 0.0) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak.

    `time_used` is the share of a wall-time budget spent so far (0..1): the decay then ends
    when the steps or the time run out, whichever comes first, so a build cut by its time
    budget still ends on a low learning rate instead of mid-schedule.
    """
    if step < budget.warmup_steps:
        return budget.lr * (step + 1) / budget.warmup_steps
    by_steps = (step - budget.warmup_steps) / max(1, budget.steps - budget.warmup_steps)
    progress = min(1.0, max(by_steps, time_used))
    floor = budget.lr * budget.min_lr_ratio
    return floor + 0.5 * (budget.lr - floor) * (1 + math.cos(math.pi * progress))


def sample_batch(tokens: np.ndarray, step: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """Random windows of `length + 1` tokens; a pure function of (seed, step), so resume is exact."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - length - 1, size=batch)
    rows = np.stack([tokens[s : s + length + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def autocast_context() -> torch.autocast | nullcontext[None]:
    """bf16 autocast where the CPU runs it fast (1.7x faster steps with AVX-512 BF16), else fp32."""
    if bf16_is_fast(torch.device("cpu")):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


def compile_module(module: nn.Module) -> nn.Module:
    """`module` through torch.compile: fused kernels for the zoo's long builds.

    Shapes are static (fixed batch and window), so it compiles once per stage (about 40 s).
    Measured on the default preset (2 cores): alone 1.09x faster target steps and no gain on
    draft steps; with `retained_freed_memory` 1.24x and 1.25x.
    """
    compiled: nn.Module = torch.compile(module, dynamic=False)  # type: ignore[assignment]
    return compiled


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}


@contextmanager
def retained_freed_memory() -> Iterator[None]:
    """Keep freed memory in the heap while training, then set glibc's default values back.

    Each step frees and re-allocates the same large buffers; by default glibc maps and unmaps
    them, which cost 10M page faults in 60 compiled steps here. Setting the values back does
    not re-enable glibc's dynamic mmap threshold (any mallopt call turns it off for the
    process). Does nothing where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        yield
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31)
    try:
        yield
    finally:
        for parameter, value in _GLIBC_DEFAULTS.items():
            libc.mallopt(parameter, value)


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's next token."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def distillation_loss(teacher: nn.Module, temperature: float) -> LossFn:
    """KL(teacher || student) on every position: the draft learns the target's whole distribution."""

    def loss(student: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits.float() / temperature
        student_logits = student(input_ids=inputs).logits.float() / temperature
        vocab = student_logits.size(-1)
        return F.kl_div(
            F.log_softmax(student_logits.reshape(-1, vocab), dim=-1),
            F.log_softmax(teacher_logits.reshape(-1, vocab), dim=-1),
            log_target=True,
            reduction="batchmean",
        ) * (temperature**2)

    return loss


@torch.no_grad()
def greedy_continuation(teacher: nn.Module, batch: torch.Tensor, generate: int) -> torch.Tensor:
    """Each row's first `len - generate` tokens followed by the teacher's greedy continuation.

    Sequence-level KD (Kim & Rush 2016): a draft distilled on these rows learns the path
    greedy speculative decoding verifies. Generated in fp32 (autocast off), the precision
    the draft's acceptance is measured in.
    """
    if not 0 < generate < batch.size(1) - 1:
        raise ValueError(
            f"generate={generate} must be > 0 and leave a prompt in windows of "
            f"{batch.size(1)} tokens; generate fewer tokens or train on longer windows"
        )
    prompt = batch[:, : batch.size(1) - generate]
    with torch.autocast(batch.device.type, enabled=False):
        rows: torch.Tensor = teacher.generate(  # type: ignore[operator]  # loosely typed
            prompt,
            max_new_tokens=generate,
            min_new_tokens=generate,  # as in greedy_agreement: no early end of text
            do_sample=False,
            pad_token_id=0,
        )
    return rows


def shared_parameters(model: PreTrainedModel) -> tuple[nn.Parameter, nn.Parameter]:
    """A Llama model's token embedding (tied to its output layer) and final norm weights."""
    embedding: Any = model.get_input_embeddings()
    norm: Any = model.model.norm  # type: ignore[union-attr]
    return embedding.weight, norm.weight


def share_embeddings(draft: PreTrainedModel, target: PreTrainedModel) -> None:
    """Give the draft the target's (tied) token embedding and final norm, frozen.

    The draft then predicts in the target's output space from the first step and trains only
    its layers; both models must be equally wide and share the tokenizer.
    """
    mine, theirs = shared_parameters(draft), shared_parameters(target)
    if mine[0].shape != theirs[0].shape:
        raise ValueError(
            f"draft embedding {tuple(mine[0].shape)} differs from the target's "
            f"{tuple(theirs[0].shape)}; share_embeddings needs equal width and vocabulary"
        )
    with torch.no_grad():
        for own, source in zip(mine, theirs, strict=True):
            own.copy_(source)
            own.requires_grad_(False)  # the tied embedding freezes the output layer too


def _make_optimizer(model: nn.Module, budget: TrainBudget) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norms and biases are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": budget.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=budget.lr, betas=(0.9, 0.95))


def train(
    model: nn.Module,
    tokens: np.ndarray,
    budget: TrainBudget,
    context: int,
    seed: int,
    loss_fn: LossFn,
    checkpoint: Path,
    checkpoint_every: int,
    progress: ProgressFn | None = None,
    compiled: bool = False,
) -> TrainResult:
    """Train `model` in place for `budget.steps`, resuming from `checkpoint` when it exists.

    `compiled` runs the forward and backward passes through `torch.compile` (the weights and
    checkpoints stay those of `model`) and keeps freed memory in the heap meanwhile.
    """
    optimizer = _make_optimizer(model, budget)
    forward = compile_module(model) if compiled else model
    start, seconds, cpu_seconds = 0, 0.0, 0.0
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, seconds = int(state["step"]), float(state["seconds"])
        cpu_seconds = float(state.get("cpu_seconds", 0.0))
    model.train()
    loss_value = float("nan")
    began = time.perf_counter() - seconds
    cpu_began = time.process_time() - cpu_seconds
    with retained_freed_memory() if compiled else nullcontext():
        for step in range(start, budget.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, budget)
            batch = sample_batch(tokens, step, budget.batch_size, context, seed)
            with autocast_context():
                loss = loss_fn(forward, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), budget.grad_clip)
            optimizer.step()
            loss_value = loss.item()
            if progress is not None:
                progress(step + 1, budget.steps, loss_value)
            if (step + 1) % checkpoint_every == 0 and step + 1 < budget.steps:
                elapsed = (time.perf_counter() - began, time.process_time() - cpu_began)
                _save_checkpoint(checkpoint, model, optimizer, step + 1, elapsed)
    model.eval()
    return TrainResult(
        steps=budget.steps,
        tokens=budget.steps * budget.batch_size * context,
        seconds=time.perf_counter() - began,
        cpu_seconds=time.process_time() - cpu_began,
        final_loss=loss_value,
    )


def _save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    elapsed: tuple[float, float],
) -> None:
    """Write atomically: a checkpoint is either complete or absent. `elapsed` is (wall, CPU) s."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "seconds": elapsed[0],
        "cpu_seconds": elapsed[1],
    }
    torch.save(state, partial)
    partial.replace(path)
