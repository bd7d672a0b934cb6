"""DP-SGD with Opacus over LoRA: accounting persists across rounds, FFA-LoRA trains B only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from opacus.accountants import RDPAccountant
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from clients.privacy.dpsgd import DPSGDConfig, cumulative_epsilon, token_records, train_dpsgd


@pytest.fixture
def lora_model() -> torch.nn.Module:
    """A tiny random Llama with LoRA on q/v projections."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def lora_tensors(model: torch.nn.Module, part: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if part in n}


def test_epsilon_accumulates_across_rounds_like_the_library(lora_model: torch.nn.Module) -> None:
    # Prepare: 40 records of 17 tokens, batch 8 -> sample rate 1/5
    tokens = np.random.default_rng(0).integers(0, 256, size=40 * 17)
    state = ConfigRecord()
    dp = DPSGDConfig(noise_multiplier=1.1, max_grad_norm=0.5)
    a_before = lora_tensors(lora_model, "lora_A")
    b_before = lora_tensors(lora_model, "lora_B")
    # Execute: two rounds, the second on a fresh call with only `state` carried over
    kw = {"steps": 3, "batch_size": 8, "seq_len": 16, "lr": 0.5, "dp": dp, "state": state}
    first = train_dpsgd(lora_model, tokens, seed=1, **kw)
    second = train_dpsgd(lora_model, tokens, seed=2, **kw)
    # Assert: the library's RDP accountant over 6 steps at q = 1/5 gives the same epsilon
    ref = RDPAccountant()
    ref.history = [(1.1, 0.2, 3), (1.1, 0.2, 3)]
    assert first.sample_rate == pytest.approx(0.2)
    assert second.epsilon == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    assert second.epsilon > first.epsilon > 0
    assert cumulative_epsilon(state, 1e-5) == pytest.approx(second.epsilon)
    # FFA-LoRA: A frozen and unchanged, B trained
    assert all(torch.equal(a_before[n], t) for n, t in lora_tensors(lora_model, "lora_A").items())
    assert any(
        not torch.equal(b_before[n], t) for n, t in lora_tensors(lora_model, "lora_B").items()
    )
    # Opacus' hooks are gone: a plain forward/backward leaves no per-sample gradients
    lora_model(input_ids=torch.randint(0, 256, (2, 8))).logits.sum().backward()
    assert all(
        not hasattr(p, "grad_sample") or p.grad_sample is None for p in lora_model.parameters()
    )


def test_token_records_refuse_a_too_short_stream() -> None:
    with pytest.raises(ValueError, match="lower seq-len"):
        token_records(np.arange(16), seq_len=16)


def test_dpsgd_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="noise_multiplier=0"):
        DPSGDConfig(noise_multiplier=0)
