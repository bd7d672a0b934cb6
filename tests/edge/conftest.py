"""Fixtures of the edge tests: micro-zoo models, a real LoRA adapter, one ONNX export, a live verifier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths


def tiny_llama(
    vocab: int, layers: int, hidden: int, seed: int, context: int = 64
) -> LlamaForCausalLM:
    """A random Llama small enough to enumerate its output distribution."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharpen the random logits a little so distributions are not flat
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def micro_target(micro_zoo: ZooPaths) -> PreTrainedModel:
    """The micro zoo's target model."""
    from fedge.models import load_causal_lm

    return load_causal_lm(micro_zoo.target_dir)


@pytest.fixture(scope="session")
def micro_draft(micro_zoo: ZooPaths) -> PreTrainedModel:
    """The micro zoo's draft model."""
    from fedge.models import load_causal_lm

    return load_causal_lm(micro_zoo.draft_dir)


@pytest.fixture(scope="session")
def micro_prompts(micro_zoo: ZooPaths) -> list[list[int]]:
    """Held-out prompts of assorted lengths (1 to 60 tokens) in the micro tokenizer."""
    from fedge.edge.prompts import heldout_prompts
    from fedge.models import load_tokenizer

    base = heldout_prompts(load_tokenizer(micro_zoo.target_dir), 24, 60)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 60, 4, 7, 11, 17, 29, 45, 6, 9, 14, 25, 40, 52, 3, 19, 33]
    return [p[:n] for p, n in zip(base, lengths, strict=True)]


@pytest.fixture(scope="session")
def lora_adapter(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real peft LoRA adapter on the micro target, with lora_B perturbed so it changes outputs."""
    from peft import LoraConfig, get_peft_model

    from fedge.models import load_causal_lm

    torch.manual_seed(
        0
    )  # lora_A's initialisation: the same adapter every run (its ONNX export is cached)
    model = get_peft_model(
        load_causal_lm(micro_zoo.target_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def verifier_port(micro_zoo: ZooPaths, micro_target: PreTrainedModel) -> Iterator[int]:
    """A live verifier on 127.0.0.1 (port 0) serving the micro target; stopped at the end."""
    config = ServerConfig(
        micro_zoo.target_dir,
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=8, batch_window_s=0.002),
    )
    server = BackgroundServer(config, micro_target)
    port = server.start()
    yield port
    server.stop(grace_s=0.2)


@pytest.fixture(scope="session")
def make_tiny_llama():  # type: ignore[no-untyped-def]
    """Factory of tiny random Llamas: make_tiny_llama(vocab, layers, hidden, seed)."""
    return tiny_llama
