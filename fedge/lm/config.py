"""The client-side training config, shared by the ClientApp and the server that sends it."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fedge.types import ConfigValue

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
    # "auto": peft's default for the architecture, else every linear layer but the head
    # (fedge.lm.targets); or comma separated module names
    lora_target_modules: str = "auto"
    local_steps: int = 8
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 2e-3  # LoRA tolerates a larger lr than full fine-tuning
    max_grad_norm: float = 1.0  # 0 disables clipping
    eval_batches: int = 8
    # "auto" (the strategy's own: SGD for SCAFFOLD, else AdamW), "adamw" or "sgd": a fixed set,
    # clients import nothing a message names
    optimizer: str = "auto"
    # "auto": bf16 autocast where the device runs it fast (AVX-512 BF16 / AMX CPUs, bf16 GPUs),
    # else fp32; "bf16" or "fp32" force one (fedge.lm.evaluate.autocast_context)
    precision: str = "auto"
    client_threads: int = 0  # torch threads per client; 0 = cores / concurrent clients

    def __post_init__(self) -> None:
        """Validate ranges, naming the field and the value."""
        positive = ("lora_r", "local_steps", "batch_size", "seq_len", "eval_batches")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{config_key(name)} must be > 0, got {getattr(self, name)}")
        if self.lr <= 0 or self.lora_alpha <= 0:
            raise ValueError(f"lr and lora-alpha must be > 0, got {self.lr} and {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.max_grad_norm < 0 or self.client_threads < 0:
            raise ValueError("max-grad-norm and client-threads must be >= 0")
        if self.optimizer not in ("auto", "adamw", "sgd"):
            raise ValueError(
                f"optimizer must be auto, adamw or sgd, got {self.optimizer!r} (clients never import "
                "a module a message names; DP-SGD is dp-sgd-noise-multiplier)"
            )
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        if not self.target_modules:
            raise ValueError("lora-target-modules is empty: name at least one module, e.g. q_proj")

    @property
    def target_modules(self) -> list[str]:
        """The LoRA target module names as a list (``["auto"]`` for the per-architecture choice)."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    @classmethod
    def from_config(cls, config: Mapping[str, ConfigValue]) -> TrainConfig:
        """Build from a flat hyphenated mapping; unknown keys are ignored, types are coerced."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            key = config_key(f.name)
            if key in config:
                values[f.name] = coerce(key, config[key], type(getattr(cls(), f.name)))
        return cls(**values)  # type: ignore[arg-type]

    def to_config(self) -> dict[str, ConfigValue]:
        """Return the flat hyphenated mapping sent to clients."""
        return {config_key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}


def config_key(field_name: str) -> str:
    """The config key of a dataclass field: its name with '-' for '_'."""
    return field_name.replace("_", "-")


def coerce(key: str, value: ConfigValue, kind: type) -> object:
    """Convert a config value to the field's type or say which key is wrong."""
    try:
        if kind is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config key '{key}' must be {kind.__name__}, got {value!r}") from exc


def derive_seed(*parts: object) -> int:
    """Return a stable 63-bit seed from any parts (same parts -> same seed, in every process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
