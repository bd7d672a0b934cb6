"""The local trainer: a few optimizer steps on a client's tokens with the strategy's hooks.

Read top to bottom: config, batches, optimizer factory, the step loop, evaluation.
The loop is model-agnostic (it takes a ``batch_loss(step)`` callable and the
trainable tensors by name), so the LoRA ClientApp and the synthetic behaviour tests
run the same code. The optimizer is built in ONE place, :func:`build_optimizer`,
selected by the ``optimizer`` config key, so DP-SGD (Opacus) can replace it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from strategies.base import ClientHook, ConfigValue

OptimizerFactory = Callable[
    [torch.nn.Module, list[torch.nn.Parameter], "TrainConfig"],
    tuple[torch.nn.Module, torch.optim.Optimizer],
]


@dataclass(frozen=True)
class TrainConfig:
    """Client-side knobs; each field's config key is its name with '-' for '_'."""

    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0  # dropout makes replayed rounds differ only via the seeded RNG
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"  # comma separated module names
    local_steps: int = 8
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 2e-3  # LoRA tolerates a larger lr than full fine-tuning
    max_grad_norm: float = 1.0  # 0 disables clipping
    eval_batches: int = 8
    optimizer: str = "adamw"  # "adamw", "sgd" or "package.module:factory"
    precision: str = "bf16"  # bf16 autocast is ~1.7x faster than fp32 on this CPU (design.md)
    client_threads: int = 0  # torch threads per client; 0 = cores / concurrent clients
    straggler_fraction: float = 0.0  # chance per round that a client is a straggler
    straggler_work: float = 0.25  # fraction of local steps a straggler completes
    device_population: str = ""  # "name:share:work,...": device classes, work = fraction of steps

    def __post_init__(self) -> None:
        """Validate ranges, naming the field and the value."""
        positive = ("lora_r", "local_steps", "batch_size", "seq_len", "eval_batches")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{_key(name)} must be > 0, got {getattr(self, name)}")
        if self.lr <= 0 or self.lora_alpha <= 0:
            raise ValueError(f"lr and lora-alpha must be > 0, got {self.lr} and {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.max_grad_norm < 0 or self.client_threads < 0:
            raise ValueError("max-grad-norm and client-threads must be >= 0")
        if not 0 <= self.straggler_fraction <= 1:
            raise ValueError(f"straggler-fraction must be in [0, 1], got {self.straggler_fraction}")
        if not 0 < self.straggler_work <= 1:
            raise ValueError(f"straggler-work must be in (0, 1], got {self.straggler_work}")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be 'bf16' or 'fp32', got {self.precision!r}")
        parse_population(self.device_population)
        if not self.target_modules:
            raise ValueError("lora-target-modules is empty: name at least one module, e.g. q_proj")

    @property
    def target_modules(self) -> list[str]:
        """The LoRA target module names as a list."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    @classmethod
    def from_config(cls, config: Mapping[str, ConfigValue]) -> TrainConfig:
        """Build from a flat hyphenated mapping; unknown keys are ignored, types are coerced."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            key = _key(f.name)
            if key in config:
                values[f.name] = _coerce(key, config[key], type(getattr(cls(), f.name)))
        return cls(**values)  # type: ignore[arg-type]

    def to_config(self) -> dict[str, ConfigValue]:
        """Return the flat hyphenated mapping sent to clients."""
        return {_key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}


def _key(field_name: str) -> str:
    return field_name.replace("_", "-")


def _coerce(key: str, value: ConfigValue, kind: type) -> object:
    """Convert a config value to the field's type or say which key is wrong."""
    try:
        if kind is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config key '{key}' must be {kind.__name__}, got {value!r}") from exc


# ---------------------------------------------------------------- seeds and batches
def derive_seed(*parts: object) -> int:
    """Return a stable 63-bit seed from any parts (same parts -> same seed, in every process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class DeviceClass:
    """A class of devices: its share of the population and the fraction of local work it finishes."""

    name: str
    share: float
    work: float


def parse_population(spec: str) -> list[DeviceClass]:
    """Parse "name:share:work,..." (shares need not sum to 1; they are normalised)."""
    classes = []
    for item in (p.strip() for p in spec.split(",") if p.strip()):
        parts = item.split(":")
        try:
            name, share, work = parts[0], float(parts[1]), float(parts[2])
        except (IndexError, ValueError) as exc:
            raise ValueError(
                f"device-population entry {item!r} must look like 'phone:0.5:0.25' "
                "(name:share:work)"
            ) from exc
        if share <= 0 or not 0 < work <= 1:
            raise ValueError(f"device-population entry {item!r}: need share > 0 and work in (0, 1]")
        classes.append(DeviceClass(name, share, work))
    return classes


def device_class(cfg: TrainConfig, seed: int, partition: int) -> DeviceClass | None:
    """Return this client's device class (fixed for the run), or None without a population."""
    classes = parse_population(cfg.device_population)
    if not classes:
        return None
    shares = np.array([c.share for c in classes])
    draw = np.random.default_rng(derive_seed(seed, "device", partition)).random()
    return classes[int(np.searchsorted(np.cumsum(shares / shares.sum()), draw, side="right"))]


def local_work(cfg: TrainConfig, seed: int, server_round: int, partition: int) -> tuple[int, float]:
    """Return (steps to run, completed fraction) for this client and round, reproducibly.

    The device class caps the work for the whole run; on top, a client straggles in a
    round with probability ``straggler-fraction`` and then does ``straggler-work`` of it.
    """
    work = 1.0
    cls = device_class(cfg, seed, partition)
    if cls is not None:
        work = cls.work
    if cfg.straggler_fraction > 0:
        rng = np.random.default_rng(derive_seed(seed, "straggler", server_round, partition))
        if rng.random() < cfg.straggler_fraction:
            work = min(work, cfg.straggler_work)
    if work >= 1.0:
        return cfg.local_steps, 1.0
    steps = max(1, min(cfg.local_steps - 1, math.floor(cfg.local_steps * work)))
    return steps, steps / cfg.local_steps


MIN_WINDOW = 8  # shortest usable window: below this a client has too little text to learn from


def random_windows(
    tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator
) -> torch.Tensor:
    """Return a (batch_size, L + 1) LongTensor of random windows, L = seq_len or less for short data."""
    length = min(seq_len, len(tokens) - 2)
    if length < MIN_WINDOW:
        raise ValueError(
            f"a token stream of {len(tokens)} tokens is too short to train on "
            f"(need at least {MIN_WINDOW + 2}); give the client more data"
        )
    starts = rng.integers(0, len(tokens) - length - 1, size=batch_size)
    rows = np.stack([np.asarray(tokens[s : s + length + 1]) for s in starts])
    return torch.from_numpy(rows.astype(np.int64))


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> Iterator[torch.Tensor]:
    """Yield up to ``max_windows`` evenly spaced, non-overlapping (1, L + 1) windows, L <= seq_len."""
    length = min(seq_len, len(tokens) - 1)
    if length < 1:
        raise ValueError(f"a held-out stream of {len(tokens)} tokens has nothing to score")
    n_full = (len(tokens) - 1) // length
    picks = np.unique(np.linspace(0, n_full - 1, num=min(n_full, max_windows)).astype(int))
    for i in picks:
        start = int(i) * length
        window = np.asarray(tokens[start : start + length + 1], dtype=np.int64)
        yield torch.from_numpy(window)[None]


# ---------------------------------------------------------------- optimizer (swappable)
def build_optimizer(
    model: torch.nn.Module, params: list[torch.nn.Parameter], cfg: TrainConfig
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Return (model, optimizer) for the trainable params; the ONE place DP-SGD replaces.

    ``cfg.optimizer`` is "adamw", "sgd" or "package.module:factory" with this
    function's signature (a factory may wrap the model, as Opacus does).
    """
    if cfg.optimizer == "adamw":
        return model, torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    if cfg.optimizer == "sgd":
        return model, torch.optim.SGD(params, lr=cfg.lr)
    from server.aggregation import load_dotted

    factory = load_dotted(cfg.optimizer, what="config key 'optimizer'")
    return factory(model, params, cfg)  # type: ignore[return-value]


def autocast_context(
    device: torch.device, precision: str
) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast when asked for (CPU or CUDA), else a no-op context."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def lm_batch_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T+1) batch: inputs [:, :-1], targets [:, 1:]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


@torch.no_grad()
def evaluate_tokens(
    model: torch.nn.Module, tokens: np.ndarray, cfg: TrainConfig, device: torch.device
) -> tuple[float, int]:
    """Return (mean token loss, tokens scored) on evenly spaced held-out windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with autocast_context(device, cfg.precision):
        for window in eval_windows(tokens, cfg.seq_len, cfg.eval_batches):
            w = window.to(device)
            loss = lm_batch_loss(model, w)
            n = w.shape[1] - 1
            total += float(loss) * n
            count += n
    model.train(was_training)
    return total / count, count
