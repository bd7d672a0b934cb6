"""A draft sharing the target's embedding: copied, frozen through distillation, refused when shapes differ."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rich.console import Console
from transformers import LlamaConfig, LlamaForCausalLM

from fedge.zoo import ZooPaths, get_preset
from fedge.zoo.build import _Builder, stale_settings, zoo_problems
from fedge.zoo.presets import ModelShape, TrainBudget
from fedge.zoo.training import (
    distillation_loss,
    next_token_loss,
    share_embeddings,
    shared_parameters,
    train,
)


def _llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def test_shared_embedding_stays_the_targets_through_distillation(tmp_path: Path) -> None:
    target, draft = _llama(32, 2, seed=0).eval(), _llama(32, 1, seed=1)
    layer_before = draft.model.layers[0].self_attn.q_proj.weight.detach().clone()
    share_embeddings(draft, target)
    tokens = np.random.default_rng(0).integers(0, 300, size=2000).astype(np.uint16)
    budget = TrainBudget(steps=3, batch_size=2, lr=1e-2, warmup_steps=1)
    loss = distillation_loss(target, temperature=1.0)
    train(draft, tokens, budget, 16, 0, loss, tmp_path / "ckpt.pt", checkpoint_every=10)

    torch.testing.assert_close(
        draft.get_input_embeddings().weight, target.get_input_embeddings().weight
    )
    torch.testing.assert_close(
        draft.get_output_embeddings().weight, target.get_input_embeddings().weight
    )
    torch.testing.assert_close(draft.model.norm.weight, target.model.norm.weight)
    assert not draft.get_input_embeddings().weight.requires_grad
    assert not torch.equal(draft.model.layers[0].self_attn.q_proj.weight, layer_before)


def test_sharing_needs_equal_widths() -> None:
    with pytest.raises(ValueError, match=r"draft embedding \(300, 16\) differs from the target's"):
        share_embeddings(_llama(16, 1, seed=1), _llama(32, 1, seed=0))
    default = get_preset("default")
    with pytest.raises(ValueError, match=r"share_embeddings needs draft.hidden=128 equal to"):
        replace(default, draft=ModelShape(layers=2, hidden=128, heads=4, intermediate=384))


def test_default_draft_owns_under_a_fifth_of_the_target() -> None:
    """Built as the zoo builds them (on the meta device: shapes, no weights), the default draft's
    own parameters (all but the embedding and final norm it shares) are under a fifth of the
    target's."""
    p = get_preset("default")

    class Vocabulary:  # what the builder reads of the tokenizer: its size and special ids
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

        def __len__(self) -> int:
            return p.vocab_size

    builder = SimpleNamespace(preset=p)
    with torch.device("meta"):
        target = LlamaForCausalLM(_Builder._config(builder, p.target, Vocabulary()))  # type: ignore[arg-type]
        draft = LlamaForCausalLM(_Builder._config(builder, p.draft, Vocabulary()))  # type: ignore[arg-type]
    assert p.share_embeddings
    share_embeddings(draft, target)
    target_total = sum(t.numel() for t in target.parameters())
    own = sum(t.numel() for t in draft.parameters() if t.requires_grad)
    assert own == sum(t.numel() for t in draft.parameters()) - sum(
        t.numel() for t in shared_parameters(draft)
    )
    assert own <= target_total / 5, (own, target_total)


def test_zoo_built_with_other_settings_is_stale(micro_zoo: ZooPaths, tmp_path: Path) -> None:
    """A card whose preset settings differ from the code's marks the zoo stale (rebuilt, not used)."""
    import json
    import shutil

    copy = ZooPaths(tmp_path / "micro")
    shutil.copytree(micro_zoo.root, copy.root)
    preset = get_preset("micro")
    assert stale_settings(copy, preset) == []
    card = copy.card
    card["preset_config"]["target_train"]["steps"] = 1
    copy.card_path.write_text(json.dumps(card))
    assert stale_settings(copy, preset) == [
        f"target_train: built {card['preset_config']['target_train']!r}, "
        f"now {json.loads(json.dumps(asdict(preset.target_train)))!r}"
    ]


def test_compiled_training_updates_the_models_own_weights(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 300, size=2000).astype(np.uint16)
    budget = TrainBudget(steps=3, batch_size=2, lr=1e-2, warmup_steps=1)
    eager, compiled = _llama(32, 1, seed=0), _llama(32, 1, seed=0)
    train(eager, tokens, budget, 16, 0, next_token_loss, tmp_path / "a.pt", checkpoint_every=10)
    train(
        compiled,
        tokens,
        budget,
        16,
        0,
        next_token_loss,
        tmp_path / "b.pt",
        checkpoint_every=10,
        compiled=True,
    )

    untrained = _llama(32, 1, seed=0).state_dict()
    for name, weight in compiled.state_dict().items():
        moved = (weight - untrained[name]).norm()
        apart = (weight - eager.state_dict()[name]).norm()
        assert apart <= 0.1 * moved, f"{name}: compiled {apart:.4f} from eager, moved {moved:.4f}"


def test_a_draft_only_change_rebuilds_the_draft_on_the_kept_target(
    micro_zoo: ZooPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preset that changes only the draft's fields keeps the built target's files untouched
    (a default-zoo target is ~50 minutes) and retrains the draft; a target field rebuilds all."""
    from fedge.zoo import PRESETS
    from fedge.zoo.build import build_zoo, draft_only

    copy = ZooPaths(tmp_path / "zoo")
    shutil.copytree(micro_zoo.root, copy.root)
    weights = copy.target_dir / "model.safetensors"
    before = (weights.read_bytes(), weights.stat().st_mtime_ns)
    micro = get_preset("micro")
    fewer = replace(micro, draft_train=replace(micro.draft_train, steps=7, warmup_steps=2))
    assert draft_only(copy, fewer)
    assert not draft_only(copy, replace(fewer, context=micro.context * 2))
    monkeypatch.setitem(PRESETS, "micro", fewer)

    build_zoo("micro", copy.root, console=Console(file=io.StringIO()))

    assert (weights.read_bytes(), weights.stat().st_mtime_ns) == before
    assert json.loads((copy.draft_dir / "training.json").read_text())["training_steps"] == 7
    assert stale_settings(copy, fewer) == []
    assert zoo_problems(copy) == []
