"""DP-SGD with Opacus over LoRA: accounting persists across rounds, FFA-LoRA trains B only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fedge.clients.privacy.dpsgd import DPSGDConfig, cumulative_epsilon, token_records, train_dpsgd
from fedge.clients.privacy.ledger import Ledger
from fedge.clients.privacy.local import BudgetExhausted, train_dpsgd_round
from fedge.strategies.base import ClientHook


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
    state: dict[str, object] = {}
    # the gradient steps alone (no loss release): Opacus' own accounting, step for step
    dp = DPSGDConfig(noise_multiplier=1.1, max_grad_norm=0.5, metric_clip=0.0)
    a_before = lora_tensors(lora_model, "lora_A")
    b_before = lora_tensors(lora_model, "lora_B")
    # Execute: two rounds, the second on a fresh call with only `state` carried over
    kw = {"steps": 3, "batch_size": 8, "seq_len": 16, "lr": 0.5, "dp": dp, "state": state}
    first = train_dpsgd(lora_model, tokens, **kw)
    second = train_dpsgd(lora_model, tokens, **kw)
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


def test_two_private_runs_with_the_same_seed_add_different_noise(
    lora_model: torch.nn.Module,
) -> None:
    # Prepare: the same model, data, settings and global seeds twice
    tokens = np.random.default_rng(0).integers(0, 256, size=40 * 17)
    start = {n: p.detach().clone() for n, p in lora_model.named_parameters()}
    dp = DPSGDConfig(noise_multiplier=1.0, max_grad_norm=0.5)
    results = []
    for _ in range(2):
        with torch.no_grad():
            for n, p in lora_model.named_parameters():
                p.copy_(start[n])
        torch.manual_seed(0)
        np.random.seed(0)
        # Execute
        kw = {"steps": 2, "batch_size": 8, "seq_len": 16, "lr": 0.5, "dp": dp}
        train_dpsgd(lora_model, tokens, state={}, **kw)  # type: ignore[arg-type]
        results.append(lora_tensors(lora_model, "lora_B"))
    # Assert: the noise (and the Poisson batches) came from the OS, not from the seeds
    assert any(not torch.equal(results[0][n], results[1][n]) for n in results[0])


def test_the_accountant_survives_a_restart_and_stops_at_the_budget(
    lora_model: torch.nn.Module, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # Prepare: a ledger on disk; a budget that admits one round of 3 steps but not two
    tokens = np.random.default_rng(0).integers(0, 256, size=40 * 17)
    dp = DPSGDConfig(noise_multiplier=1.1, max_grad_norm=0.5)
    z = dp.accounted_multiplier  # each step also releases the noised loss sum: z / sqrt(2)
    ref = RDPAccountant()
    ref.history = [(z, 0.2, 3)]
    one_round = ref.get_epsilon(1e-5)
    ref.history = [(z, 0.2, 3), (z, 0.2, 3)]
    budget = (one_round + ref.get_epsilon(1e-5)) / 2
    path = tmp_path / "ledger.json"
    hook = ClientHook()
    kw = {"steps": 3, "batch_size": 8, "seq_len": 16, "lr": 0.5, "dp": dp, "hook": hook}
    # Execute: one round, then a "restarted" node (a new Ledger object on the same file)
    _, metrics = train_dpsgd_round(
        lora_model, tokens, ledger=Ledger(path), max_epsilon=budget, **kw
    )  # type: ignore[arg-type]
    # Assert: the epsilon is on disk; the second round would pass the budget and is refused
    assert metrics["dp-sgd-epsilon"] == pytest.approx(one_round)
    with pytest.raises(BudgetExhausted, match="privacy budget exhausted"):
        train_dpsgd_round(lora_model, tokens, ledger=Ledger(path), max_epsilon=budget, **kw)  # type: ignore[arg-type]
    assert cumulative_epsilon(Ledger(path).load()["dp-sgd"], 1e-5) == pytest.approx(one_round)
