"""Training precision: "auto" (the default) takes bf16 autocast only where the device runs it fast."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fedge.lm.config import TrainConfig
from fedge.lm.evaluate import autocast_context, bf16_is_fast


def test_auto_is_the_default_and_follows_the_device() -> None:
    """The default was bf16 everywhere: on this project's AVX2-only CPU a LoRA step ran 9-12x
    slower than fp32 (emulated bf16). "auto" autocasts exactly when the CPU has AVX-512 BF16 or
    AMX; "bf16" and "fp32" still force one."""
    cpu = torch.device("cpu")
    assert TrainConfig().precision == "auto"
    auto = autocast_context(cpu, "auto")
    assert isinstance(auto, torch.autocast) == bf16_is_fast(cpu)
    assert isinstance(autocast_context(cpu, "bf16"), torch.autocast)
    assert isinstance(autocast_context(cpu, "fp32"), contextlib.nullcontext)


def test_an_unknown_precision_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'auto', 'bf16' or 'fp32'.*'fp16'"):
        TrainConfig(precision="fp16")
