"""4,096-token prompts through rings of 2 and 4 processes equal one process within 1e-4 (fp32).

Minutes on two cores: only `make test-ring` runs these (-m ring). Models: the default zoo's
target (trained when `fedge models build --preset default` has built it under FEDGE_HOME, else
the same architecture and shape with seeded random weights), a random-weights HF Llama with
grouped-query attention (8 query heads over 2 KV heads), and a random-weights Qwen2 (GQA plus
biased projections). Each case also checks a decode step on the sharded KV.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from fedge.edge.verifier.batching import KVGeometry
from fedge.edge.verifier.ring import RingConfig, RingPool
from tests.architectures import random_gqa

pytestmark = pytest.mark.ring
LENGTH = 4096


def default_zoo_target() -> PreTrainedModel:
    """The default zoo's target, or its architecture with random weights when it is not built."""
    from fedge.models import load_causal_lm
    from fedge.paths import zoo_dir
    from fedge.zoo.build import ZooPaths, zoo_problems
    from fedge.zoo.presets import get_preset

    preset = get_preset("default")
    paths = ZooPaths(zoo_dir("default"))
    if not zoo_problems(paths):
        return load_causal_lm(paths.target_dir)
    torch.manual_seed(0)
    shape = preset.target
    config = LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=preset.context * 4,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def llama_gqa() -> PreTrainedModel:
    return random_gqa("llama", 1, heads=8, kv_heads=2, positions=LENGTH + 64)


def qwen2_gqa() -> PreTrainedModel:
    return random_gqa(
        "qwen2", 2, heads=4, kv_heads=2, positions=LENGTH + 64, use_sliding_window=False
    )


MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "default-zoo-target": default_zoo_target,
    "hf-llama-gqa": llama_gqa,
    "hf-qwen2-gqa": qwen2_gqa,
}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_4096_token_prompt_through_ring_equals_one_process(name: str, size: int) -> None:
    model = MODELS[name]()
    tokens = torch.randint(3, 1000, (LENGTH,), generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        expected = model(input_ids=tokens[None]).logits
        after = model(input_ids=torch.cat([tokens, torch.tensor([5, 6, 7])])[None]).logits[:, -3:]
    pool = RingPool(
        model,
        RingConfig(size=size, threshold=2 * size, block=256, kv_cap_bytes=1 << 34),
        KVGeometry.of(model).bytes_per_position,
    )
    try:
        kv, logits = pool.prefill(tokens.tolist(), want_logits=True)
        step = pool.step(kv, [5, 6, 7])
    finally:
        pool.stop()
    error = (logits - expected).abs().max().item()
    step_error = (step - after).abs().max().item()
    print(f"{name} ring={size}: prefill max |diff| {error:.2e}, decode step {step_error:.2e}")
    assert error < 1e-4
    assert step_error < 1e-4
