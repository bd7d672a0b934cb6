"""Workload costs by hand: FLOPs per step, peak training memory, memory fit, step times."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.devicesim.population import KIND_FLOPS, KIND_MS_PER_SAMPLE, KIND_SPEED, Population
from simulations.devicesim.workload import REFERENCE_MODELS, ModelShape, Workload, fit_batches

# params 1000, hidden 8, 2 layers, 2 heads, vocab 16, untied; 100 LoRA params; batch 4 x seq 8.
SHAPE = ModelShape(
    params=1000, hidden=8, layers=2, heads=2, kv_dim=8, intermediate=32, vocab=16, tied=False
)
WORK = Workload(
    SHAPE, lora_params=100, batch=4, seq=8, local_steps=3, download_bytes=400, upload_bytes=408
)


def test_memory_estimate_by_hand() -> None:
    """weights 1000 x 2 (fp16) = 2000; LoRA 100 x 4 x (1 + 1 + 2 AdamW states) = 1600;
    activations 2 layers x 8 x 4 x 8 x (34 + 5 x 2 x 8 / 8) = 22528; logits 8 x 4 x 8 x 16 = 4096."""
    assert WORK.memory_bytes() == pytest.approx(2000 + 1600 + 22528 + 4096)
    assert WORK.memory_bytes(2) == pytest.approx(2000 + 1600 + 11264 + 2048)
    sgd = Workload(**{**WORK.__dict__, "optimizer": "sgd", "weight_dtype": "int8"})
    assert sgd.memory_bytes() == pytest.approx(1000 + 800 + 22528 + 4096)


def test_flops_per_step_by_hand() -> None:
    """T = 32 tokens x (4 x (1000 - 16 x 8) + 6 x 100 + 12 x 2 x 8 x 8) = 32 x 5624."""
    assert WORK.flops_per_step() == pytest.approx(32 * 5624)


def test_memory_fit_excludes_or_shrinks_the_batch() -> None:
    """Needs 30224 B at batch 4, 16912 at 2, 10256 at 1."""
    memory = np.array([40_000.0, 20_000.0, 12_000.0, 5_000.0])
    assert list(fit_batches(WORK, memory, shrink=False)) == [4, 0, 0, 0]
    assert list(fit_batches(WORK, memory, shrink=True)) == [4, 2, 1, 0]


def test_step_seconds_for_each_kind_of_throughput() -> None:
    """FLOP/s: flops / rate; speed: flops / (speed x machine rate); FedScale: 3 x batch x ms / 1000."""
    n = 3
    pop = Population(
        ("t",), np.zeros(n, np.int16), np.array([KIND_FLOPS, KIND_SPEED, KIND_MS_PER_SAMPLE], np.int8),
        np.array([1e6, 2.0, 10.0]), np.ones(n), np.ones(n), np.ones(n), np.zeros(n),
        np.zeros(n + 1, np.int64), np.empty(0), np.empty(0), np.zeros(n),
    )  # fmt: skip
    with pytest.raises(ValueError, match="no step time was measured"):
        WORK.step_seconds(pop)
    calibrated = WORK.with_machine(step_seconds=0.5, flops_per_step=1e6)  # 2 MFLOP/s here
    got = calibrated.step_seconds(pop, np.array([4, 4, 2]))
    assert got[0] == pytest.approx(32 * 5624 / 1e6)
    assert got[1] == pytest.approx(32 * 5624 / (2.0 * 2e6))
    assert got[2] == pytest.approx(3 * 2 * 10.0 / 1000)


def test_reference_shape_counts_qwen25_05b() -> None:
    """Qwen2.5-0.5B has 494M parameters; LoRA r=8 on q,k,v,o: 24 x 8 x (6 x 896 + 2 x 128)."""
    shape = REFERENCE_MODELS["qwen2.5-0.5b"]
    assert shape.params == pytest.approx(494e6, rel=0.01)
    assert shape.lora_params(8, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 24 * 8 * (
        6 * 896 + 2 * 128
    )
    with pytest.raises(ValueError, match="no shape for LoRA target"):
        shape.lora_params(8, ["c_attn"])
