"""`fedge models draft`: a draft for any target (here the micro zoo's target, a 1-layer draft,
seconds of distillation) that loads as an ordinary folder and presents the full vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fedge.zoo import ZooPaths
from fedge.zoo.draft import CARD_NAME, VOCAB_NAME, DraftSpec, build_draft

SPEC = DraftSpec(
    layers=1,
    vocab=300,
    steps=12,
    batch_size=4,
    context=32,
    eval_every=4,
    prompts=4,
    prompt_tokens=16,
    new_tokens=8,
    max_chars_per_label=10_000,
)


@pytest.fixture(scope="module")
def built(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step in a first run, then --resume finishes the schedule."""
    out = tmp_path_factory.mktemp("draft-any")
    build_draft(micro_zoo.target_dir, out, SPEC, stop_after=1)
    build_draft(micro_zoo.target_dir, out, SPEC, minutes=5.0, resume=True)
    return out


def test_the_draft_is_an_ordinary_folder_with_the_targets_full_vocabulary(
    micro_zoo: ZooPaths, built: Path
) -> None:
    target = AutoModelForCausalLM.from_pretrained(micro_zoo.target_dir)
    draft = AutoModelForCausalLM.from_pretrained(built)
    assert draft.config.num_hidden_layers == 1
    assert draft.config.vocab_size == target.config.vocab_size
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    ids = torch.tensor(json.loads((built / VOCAB_NAME).read_text()))
    assert 0 < len(ids) < target.config.vocab_size
    logits = draft(input_ids=torch.tensor([[5, 17, 99, 3, 42]])).logits[0]
    assert logits.shape[-1] == target.config.vocab_size
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[ids] = False
    # every excluded token scores far below the best restricted one: never proposed
    best_inside = logits[:, ids].max(-1).values
    assert (logits[:, outside].max(-1).values < best_inside - 10).all()


def test_resume_continues_the_schedule_and_the_card_records_the_curve(built: Path) -> None:
    card = json.loads((built / CARD_NAME).read_text())
    assert card["steps"] == SPEC.steps  # the first run stopped at 1, the resumed one finished
    steps = [p["step"] for p in card["agreement_curve"]]
    assert steps[0] == 0 and steps[1] == 1 and steps[-1] == SPEC.steps
    assert steps == sorted(steps) and len(steps) == len(set(steps))
    assert 0.0 <= card["greedy_agreement"] <= 1.0
    assert card["excluded_rows"]["heldout_argmax_outside_restricted"] == 0.0
    assert card["restricted_vocab"]["size"] <= SPEC.vocab + 3


def test_resume_with_other_settings_is_refused(micro_zoo: ZooPaths, built: Path) -> None:
    with pytest.raises(ValueError, match=r"settings differ"):
        build_draft(micro_zoo.target_dir, built, DraftSpec(layers=1, vocab=100), resume=True)


def test_the_export_computes_only_the_restricted_rows_and_validates(
    micro_zoo: ZooPaths, built: Path, tmp_path: Path
) -> None:
    """The ONNX draft computes N head columns (and one shared) instead of V (the head is most of a small
    draft's compute) and still matches the torch folder's full-vocabulary logits."""
    import onnx
    from onnx import numpy_helper

    from fedge.edge.export import ExportConfig, export_draft
    from fedge.edge.prompts import heldout_prompts
    from fedge.models import load_tokenizer

    prompts = heldout_prompts(load_tokenizer(micro_zoo.target_dir), 3, 16)

    manifest = export_draft(built, tmp_path, prompts, ExportConfig(steps=4, timing_steps=1))
    assert manifest["vocab_size"] == 1024
    for variant in ("fp32", "int8", "int4"):
        assert manifest["variants"][variant]["valid"], manifest["variants"][variant]["failures"]
    assert manifest["variants"]["fp32"]["greedy_agreement"] == 1.0
    graph = onnx.load(str(tmp_path / "draft.fp32.onnx")).graph
    weights = {t.name: numpy_helper.to_array(t).shape for t in graph.initializer}
    ids = json.loads((built / VOCAB_NAME).read_text())
    head_shapes = [
        weights[n.input[1]] for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights
    ]
    assert any(s[-1] == len(ids) for s in head_shapes)  # the restricted rows
    assert not any(1024 in s for s in head_shapes)  # no full-vocabulary matrix product
