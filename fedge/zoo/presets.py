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
    # The draft reuses the target's token embedding (tied to its output layer) and final norm,
    # frozen: its logits live in the target's output space from step one, and its own
    # parameters are only its layers. Needs draft.hidden == target.hidden.
    share_embeddings: bool = False
    max_chars_per_label: int | None = None  # None: the whole standard library
    eval_windows: int = 64  # held-out windows for perplexity
    agreement_prompts: int = 32  # held-out prompts for the draft's greedy agreement
    agreement_tokens: int = 48  # greedy tokens the target generates per prompt
    checkpoint_every: int = 100  # steps between resumable training checkpoints
    threads: int = 2  # fixed so reductions, and so the weights, do not depend on the machine
    # torch.compile for training, with freed memory kept in the heap (about 40 s per stage to
    # compile, then 1.24x faster steps here): worth it only for long builds, so the small
    # presets train eagerly.
    compiled: bool = False
    special_tokens: tuple[str, ...] = field(default=("<|endoftext|>", "<|pad|>"))

    def __post_init__(self) -> None:
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size={self.vocab_size} must exceed the 256 byte symbols")
        if self.share_embeddings and self.draft.hidden != self.target.hidden:
            raise ValueError(
                f"share_embeddings needs draft.hidden={self.draft.hidden} equal to "
                f"target.hidden={self.target.hidden}"
            )


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
        # Compiled, a 6x256 target step takes 0.88 s on 2 quiet cores (bf16 autocast) and a draft
        # distillation step 0.55 s, so 1,250 + 2,800 steps build in about 45 minutes (1,000 target
        # steps left held-out perplexity at 42). Draft agreement: 78.8% after 700 steps, 82.0%
        # after 1,400, 85.0% after 2,800. Speculative decoding needs the draft to allow <= 0.25
        # round trips per token at 20 ms: 0.276, 0.247 and 0.202 drafting 16 every round.
        target=ModelShape(layers=6, hidden=256, heads=4, intermediate=688),
        # As wide as the target, so it shares the target's embedding (its own parameters are
        # under a fifth of the target's) and 4-bit weights pay on the edge (1.7x measured at
        # 256 wide, none at 128); two layers so it can learn to copy identifiers from context.
        draft=ModelShape(layers=2, hidden=256, heads=4, intermediate=384),
        target_train=TrainBudget(steps=1250, batch_size=16, lr=2e-3, warmup_steps=80),
        draft_train=TrainBudget(steps=2800, batch_size=16, lr=3e-3, warmup_steps=50),
        share_embeddings=True,
        compiled=True,
    ),
}


def get_preset(name: str) -> ZooPreset:
    """The preset called `name`, or a ValueError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"Unknown zoo preset {name!r}; choose one of {sorted(PRESETS)}.") from None


DRAFT_MINUTES = 10.0  # a draft build's wall-time budget when none is given
GREEDY_PRECISIONS = ("auto", "bf16", "fp32")  # DraftSpec.greedy_precision


@dataclass(frozen=True)
class DraftSpec:
    """What determines a draft build (a resumed build must use the same)."""

    # The target's first and last layers the draft starts from (the last turn a hidden state
    # into a prediction). 4 + 2 of SmolLM2's 30 agreed with it 1.4 to 6.1 points more (3.2 on
    # average) than 2 + 1 at steps 200 to 400 of the same recipe, for 15% more time a step;
    # the draft's step stays a few ms on ONNX Runtime against a ~35 ms verify. 6 + 2 was level
    # at equal build time (docs/draft.md).
    layers: int = 4
    last_layers: int = 2
    vocab: int = 8192
    steps: int = 4000  # most steps; the learning rate decays over these or the time budget
    batch_size: int = 8
    context: int = 128
    lr: float = 1e-3
    warmup_steps: int = 20
    temperature: float = 1.0
    eval_every: int = 50  # steps between agreement measurements (and checkpoints)
    prompts: int = 16
    prompt_tokens: int = 32
    new_tokens: int = 32
    max_chars_per_label: int = 100_000  # stdlib characters per package read for data
    # sequence-level KD: the target's greedy continuations of training prompts, generated once.
    # Distinct rows matter more than steps: a SmolLM2 draft trained ~5 epochs on 1,024 rows
    # agreed with the target on 85% of those rows' positions and 45% of held-out paths.
    # continuations cached in the build folder (0: windows only); a chunk joins every
    # `greedy_every` steps, so a build reaches the cap only past step greedy_every x chunks
    greedy_rows: int = 8192
    greedy_prompt_tokens: int = 32
    greedy_tokens: int = 64  # generated per row; the loss is on these positions
    # rows per generate call (and per cached chunk): SmolLM2 generates 176 tokens/s at 32 rows,
    # 253 at 128 (2 cores), and generation is half of a build's time
    greedy_batch: int = 128
    greedy_every: int = 32  # steps between chunks: 32 steps draw 128 greedy rows, one chunk's worth
    greedy_share: float = 0.5  # of each training batch, the share of greedy rows
    top_k: int = 64  # teacher log-probs kept per generated position (restricted rows)
    # the target's precision while it generates greedy rows. "auto": bf16 where the CPU runs
    # it fast (SmolLM2, 128 rows: 502 against 337 tokens/s fp32; on the fp32 target's own paths
    # its top-1 token is the fp32 one at 98.5% of positions), else fp32. Agreement is always
    # measured against the fp32 target.
    greedy_precision: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ["layers", "vocab", "steps", "batch_size", "context", "eval_every"]
        positive += ["greedy_prompt_tokens", "greedy_tokens", "greedy_batch", "top_k"]
        positive += ["greedy_every"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"draft {name} must be > 0, got {getattr(self, name)}")
        if self.last_layers < 0 or self.greedy_rows < 0:
            raise ValueError("draft last_layers and greedy_rows must be >= 0")
        if self.greedy_precision not in GREEDY_PRECISIONS:
            raise ValueError(
                f"draft greedy_precision must be one of {GREEDY_PRECISIONS}, "
                f"got {self.greedy_precision!r}"
            )
        if not 0.0 <= self.greedy_share <= 1.0:
            raise ValueError(f"draft greedy_share must be in [0, 1], got {self.greedy_share}")

    def budget(self) -> TrainBudget:
        return TrainBudget(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            warmup_steps=min(self.warmup_steps, self.steps - 1),
            weight_decay=0.0,
        )
