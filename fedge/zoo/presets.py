"""Zoo presets: the size of the tokenizer, target and draft, and how long each trains.

Budgets are step counts, not wall-clock time, so a preset and seed give byte-identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture shape; vocabulary and context come from the preset."""

    layers: int
    hidden: int
    heads: int
    intermediate: int

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")


@dataclass(frozen=True)
class TrainBudget:
    """Optimiser settings for one training stage."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1  # cosine decays to 10% of peak: ends stable without freezing
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # keeps the early high-lr steps from diverging

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0:
            raise ValueError(
                f"steps={self.steps} and batch_size={self.batch_size} must be positive"
            )
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must lie in [0, steps={self.steps})"
            )


@dataclass(frozen=True)
class ZooPreset:
    """Everything that determines a zoo build besides the seed."""

    name: str
    vocab_size: int
    context: int  # training sequence length and max_position_embeddings
    target: ModelShape
    draft: ModelShape
    target_train: TrainBudget
    draft_train: TrainBudget
    distill_temperature: float = 1.0
    max_chars_per_label: int | None = None  # None: the whole standard library
    eval_windows: int = 64  # held-out windows for perplexity
    agreement_prompts: int = 32  # held-out prompts for the draft's greedy agreement
    agreement_tokens: int = 48  # greedy tokens the target generates per prompt
    checkpoint_every: int = 100  # steps between resumable training checkpoints
    threads: int = 2  # fixed so reductions, and so the weights, do not depend on the machine
    special_tokens: tuple[str, ...] = field(default=("<|endoftext|>", "<|pad|>"))

    def __post_init__(self) -> None:
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size={self.vocab_size} must exceed the 256 byte symbols")


PRESETS: dict[str, ZooPreset] = {
    "micro": ZooPreset(
        name="micro",
        vocab_size=1024,
        context=128,
        target=ModelShape(layers=2, hidden=64, heads=2, intermediate=172),
        draft=ModelShape(layers=1, hidden=32, heads=2, intermediate=86),
        target_train=TrainBudget(steps=80, batch_size=16, lr=3e-3, warmup_steps=8),
        draft_train=TrainBudget(steps=60, batch_size=16, lr=3e-3, warmup_steps=6),
        max_chars_per_label=20_000,
        eval_windows=16,
        agreement_prompts=8,
        agreement_tokens=24,
        checkpoint_every=40,
    ),
    "demo": ZooPreset(
        name="demo",
        vocab_size=2048,
        context=128,
        target=ModelShape(layers=3, hidden=96, heads=4, intermediate=256),
        draft=ModelShape(layers=1, hidden=64, heads=2, intermediate=172),
        target_train=TrainBudget(steps=400, batch_size=16, lr=3e-3, warmup_steps=30),
        draft_train=TrainBudget(steps=250, batch_size=16, lr=3e-3, warmup_steps=20),
        max_chars_per_label=300_000,
        eval_windows=48,
        agreement_prompts=24,
    ),
    "default": ZooPreset(
        name="default",
        vocab_size=4096,
        context=256,
        # Compute-bound (about 6k tokens/s on 2 cores): a small target trained on ~one epoch
        # beats a wide one trained on a fraction of the corpus.
        target=ModelShape(layers=4, hidden=128, heads=4, intermediate=384),
        draft=ModelShape(layers=1, hidden=128, heads=4, intermediate=256),
        target_train=TrainBudget(steps=750, batch_size=16, lr=3e-3, warmup_steps=50),
        draft_train=TrainBudget(steps=450, batch_size=16, lr=3e-3, warmup_steps=30),
    ),
}


def get_preset(name: str) -> ZooPreset:
    """The preset called `name`, or a ValueError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"Unknown zoo preset {name!r}; choose one of {sorted(PRESETS)}.") from None
