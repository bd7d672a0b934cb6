"""Workload costs by hand: FLOPs per step, peak training memory, memory fit, step times."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fedge.simulations.devicesim.population import (
    KIND_FLOPS,
    KIND_MS_PER_SAMPLE,
    KIND_SPEED,
    Population,
)
from fedge.simulations.devicesim.workload import REFERENCE_MODELS, ModelShape, Workload, fit_batches

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
    # FedScale's figures describing this very workload (reference 0): 3 x batch x ms / 1000
    own = replace(calibrated, reference_flops=0.0).step_seconds(pop, np.array([4, 4, 2]))
    assert own[2] == pytest.approx(3 * 2 * 10.0 / 1000)


def test_fedscale_ms_per_sample_scales_with_the_workload_flops() -> None:
    """A FedScale device takes 10 ms per sample of the reference (0.6 GFLOP forward), 30 ms to
    train one (1.8 GFLOP): 60 GFLOP/s. A Qwen2.5-0.5B LoRA step (batch 2 x seq 8, about 32
    GFLOP) then takes F / 60e9 s, 0.53 s, about 9x the reference's 3 x 2 x 10 ms (on main
    FedScale rows ignored the model: the 0.5B LLM step was timed like the reference's, 0.06 s)."""
    n = 1
    pop = Population(
        ("t",), np.zeros(n, np.int16), np.array([KIND_MS_PER_SAMPLE], np.int8), np.array([10.0]),
        np.ones(n), np.ones(n), np.ones(n), np.zeros(n), np.zeros(n + 1, np.int64), np.empty(0),
        np.empty(0), np.zeros(n),
    )  # fmt: skip
    qwen = REFERENCE_MODELS["qwen2.5-0.5b"]
    lora = qwen.lora_params(8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    llm = Workload(qwen, lora, batch=2, seq=8, local_steps=1, download_bytes=0, upload_bytes=0)
    step = llm.step_seconds(pop)[0]
    assert step == pytest.approx(llm.flops_per_step() / 60e9)
    assert step > 5 * (3 * 2 * 10.0 / 1000)


def test_auto_optimizer_counts_adamw_state_in_device_memory(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """``optimizer = "auto"`` trains FedAvg with AdamW: its 2 fp32 states per LoRA parameter
    (8 bytes each) are in the memory estimate; SCAFFOLD's SGD holds none (on main "auto"
    matched neither name and the AdamW states were left out)."""
    from fedge.server.config import RunConfig
    from fedge.simulations.devicesim.config import DeviceConfig
    from fedge.simulations.devicesim.setup import build_workload

    base = {"model": str(micro_zoo.target_dir), "optimizer": "auto"}
    fedavg = build_workload(DeviceConfig(), RunConfig.from_mapping(base), needs_machine=False)
    scaffold = build_workload(
        DeviceConfig(), RunConfig.from_mapping({**base, "strategy": "scaffold"}), False
    )
    assert (fedavg.optimizer, scaffold.optimizer) == ("adamw", "sgd")
    assert fedavg.memory_bytes() - scaffold.memory_bytes() == pytest.approx(8 * fedavg.lora_params)
    with pytest.raises(ValueError, match="resolve 'auto'"):
        replace(fedavg, optimizer="auto")


def test_reference_shape_counts_qwen25_05b() -> None:
    """Qwen2.5-0.5B has 494M parameters; LoRA r=8 on q,k,v,o: 24 x 8 x (6 x 896 + 2 x 128)."""
    shape = REFERENCE_MODELS["qwen2.5-0.5b"]
    assert shape.params == pytest.approx(494e6, rel=0.01)
    assert shape.lora_params(8, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 24 * 8 * (
        6 * 896 + 2 * 128
    )
    with pytest.raises(ValueError, match="no shape for LoRA target"):
        shape.lora_params(8, ["c_attn"])


def test_auto_lora_targets_resolve_on_the_timing_reference() -> None:
    """The run config's default targets ("auto") time Qwen2's peft default, q_proj and v_proj.

    Before, a timing model with the default targets stopped with "no shape for LoRA target(s)
    ['auto']". By hand: 24 layers x r 8 x ((896 + 896) + (896 + 128)) = 540,672.
    """
    from fedge.simulations.devicesim.workload import REFERENCE_MODELS

    reference = REFERENCE_MODELS["qwen2.5-0.5b"]
    assert reference.lora_params(8, ["auto"]) == 24 * 8 * ((896 + 896) + (896 + 128)) == 540_672
    assert reference.lora_params(8, ["auto"]) == reference.lora_params(8, ["q_proj", "v_proj"])
