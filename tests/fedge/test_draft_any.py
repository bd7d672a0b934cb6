"""`fedge models draft`: a draft for any target (here the micro zoo's target, a 1-layer draft,
seconds of distillation on windows and on the target's cached greedy continuations) that loads
as an ordinary folder and presents the full vocabulary; and the first + last layer selection
on a 4-layer target the test writes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fedge.zoo import ZooPaths
from fedge.zoo.draft import (
    CARD_NAME,
    VOCAB_NAME,
    WORK_DIR,
    DraftSpec,
    _greedy_data,
    build_draft,
    draft_layers,
    greedy_generator,
    init_draft,
)

SPEC = DraftSpec(
    layers=1,
    last_layers=0,  # the micro target has 2 layers
    greedy_rows=12,
    greedy_prompt_tokens=8,
    greedy_tokens=8,
    greedy_batch=8,  # two chunks, the second of 4 rows, drawn from step 4 on
    greedy_every=4,
    top_k=16,
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
        build_draft(micro_zoo.target_dir, built, replace(SPEC, vocab=100), resume=True)


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


def test_the_greedy_rows_are_the_targets_own_continuations_and_its_top_k(
    micro_zoo: ZooPaths, built: Path
) -> None:
    """Sequence-level KD data: each cached row is a train prompt and the greedy continuation of
    the target at the build's precision (regenerated chunk by chunk, the batches the build
    used); the recorded top-1 restricted token is the generated one where it is kept."""
    from fedge.models import load_causal_lm

    generator = greedy_generator(load_causal_lm(micro_zoo.target_dir).eval(), "auto")
    card = json.loads((built / CARD_NAME).read_text())
    assert card["data"]["greedy_precision"] == str(generator.dtype).removeprefix("torch.")
    ids = torch.tensor(json.loads((built / VOCAB_NAME).read_text()))
    chunks = [torch.load(p) for p in sorted((built / WORK_DIR).glob("greedy-*.pt"))]
    assert [c["rows"].shape[0] for c in chunks] == [8, 4]
    prompt = chunks[0]["rows"].shape[1] - SPEC.greedy_tokens
    for chunk in chunks:
        rows = chunk["rows"].long()
        again = generator.generate(
            rows[:, :prompt],
            attention_mask=torch.ones_like(rows[:, :prompt]),
            max_new_tokens=SPEC.greedy_tokens,
            min_new_tokens=SPEC.greedy_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        assert torch.equal(again, rows)
    rows = torch.cat([c["rows"] for c in chunks]).long()
    values = torch.cat([c["values"] for c in chunks]).float()
    indices = torch.cat([c["indices"] for c in chunks]).long()
    assert values.shape == indices.shape == (12, SPEC.greedy_tokens, SPEC.top_k)
    assert (values[..., :-1] >= values[..., 1:]).all() and (values <= 0).all()
    generated = rows[:, prompt:]
    kept = torch.isin(generated, ids)
    assert kept.float().mean() > 0.5
    assert torch.equal(ids[indices[..., 0]][kept], generated[kept])


def test_greedy_rows_come_from_a_bf16_copy_only_where_asked_or_fast(micro_zoo: ZooPaths) -> None:
    """Rows come from the target itself for "fp32", from a bf16 copy that leaves the target
    in fp32 for "bf16", and from bf16 for "auto" exactly where the CPU runs it fast; any
    other name is refused."""
    from fedge.lm.evaluate import bf16_is_fast
    from fedge.models import load_causal_lm

    target = load_causal_lm(micro_zoo.target_dir).eval()
    assert greedy_generator(target, "fp32") is target
    copy = greedy_generator(target, "bf16")
    assert copy is not target and copy.dtype == torch.bfloat16 and target.dtype == torch.float32
    weight = target.model.embed_tokens.weight
    assert torch.equal(copy.model.embed_tokens.weight, weight.to(torch.bfloat16))
    fast = bf16_is_fast(torch.device("cpu"))
    assert greedy_generator(target, "auto").dtype == (torch.bfloat16 if fast else torch.float32)
    with pytest.raises(ValueError, match=r"greedy_precision must be one of .*'fp16'"):
        DraftSpec(greedy_precision="fp16")


def test_greedy_rows_grown_a_chunk_at_a_time_are_the_rows_read_at_once(built: Path) -> None:
    """A build adds each new chunk to the rows it holds (no re-reading every chunk per chunk);
    what it trains on must be what a resumed build reads from the cached chunks at once."""
    ids = torch.tensor(json.loads((built / VOCAB_NAME).read_text()))
    args = (built / WORK_DIR, None, np.zeros(1, dtype=np.uint32), ids, SPEC, None)
    first = _greedy_data(*args, 1)
    grown = _greedy_data(*args, 2, first)
    whole = _greedy_data(*args, 2)
    assert first is not None and grown is not None and whole is not None
    assert grown.rows.shape[0] == SPEC.greedy_rows
    for name in ("rows", "values", "indices"):
        assert torch.equal(getattr(grown, name), getattr(whole, name))


def test_the_cli_refuses_an_unknown_greedy_precision_before_building(
    micro_zoo: ZooPaths, tmp_path: Path
) -> None:
    """A typo in --greedy-precision is a clear error naming the choices, not a traceback, and
    no build folder is started."""
    from typer.testing import CliRunner

    from fedge.cli.main import app

    out = tmp_path / "draft"
    args = ["models", "draft", "--target", str(micro_zoo.target_dir), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--greedy-precision", "fp16"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "greedy_precision must be one of" in said and "'fp32'" in said
    assert not out.exists()


@pytest.fixture(scope="module")
def four_layers(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer target of the micro zoo's width and tokenizer, seeded random weights."""
    from fedge.models import load_tokenizer

    config = AutoModelForCausalLM.from_pretrained(micro_zoo.target_dir).config
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path_factory.mktemp("four-layers")
    model.save_pretrained(out)
    load_tokenizer(micro_zoo.target_dir).save_pretrained(out)
    return out


def test_the_draft_copies_the_targets_first_and_last_layers(four_layers: Path) -> None:
    target = AutoModelForCausalLM.from_pretrained(four_layers)
    draft = init_draft(target, 1, 2)
    assert draft.config.num_hidden_layers == 3
    for mine, theirs in zip(draft.model.layers, [0, 2, 3], strict=True):
        source = target.model.layers[theirs].state_dict()
        for name, tensor in mine.state_dict().items():
            assert torch.equal(tensor, source[name]), (theirs, name)
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    assert draft_layers(30, 2, 1) == [0, 1, 29]
    for first, last in [(0, 1), (2, 2), (3, 1), (1, -1)]:
        with pytest.raises(ValueError, match="first"):
            init_draft(target, first, last)


def test_a_first_and_last_layer_draft_saves_as_a_plain_folder_and_resumes_only_alike(
    four_layers: Path, tmp_path: Path
) -> None:
    """No training step: the saved folder's layers are the target's layers 0, 3 exactly, and a
    resume that asks for another layer selection (a key an older build did not record too) is
    refused rather than mixing checkpoints of different shapes."""
    spec = DraftSpec(
        layers=1,
        last_layers=1,
        vocab=200,
        steps=4,
        batch_size=2,
        context=16,
        eval_every=2,
        prompts=2,
        prompt_tokens=8,
        new_tokens=4,
        max_chars_per_label=5_000,
        greedy_rows=2,
        greedy_prompt_tokens=4,
        greedy_tokens=4,
        greedy_batch=2,
    )
    card = build_draft(four_layers, tmp_path, spec, stop_after=0)
    assert card["layers"] == {"target_layers": [0, 3], "of": 4}
    assert 0 < card["cost"]["relative"] < 1
    target = AutoModelForCausalLM.from_pretrained(four_layers)
    draft = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert draft.config.num_hidden_layers == 2
    assert torch.equal(
        draft.model.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight
    )
    with pytest.raises(ValueError, match=r"settings differ"):
        build_draft(four_layers, tmp_path, replace(spec, last_layers=2), resume=True)
    recorded = json.loads((tmp_path / WORK_DIR / "spec.json").read_text())
    del recorded["last_layers"]  # a build from before the option existed
    (tmp_path / WORK_DIR / "spec.json").write_text(json.dumps(recorded))
    with pytest.raises(ValueError, match=r"last_layers"):
        build_draft(four_layers, tmp_path, spec, resume=True)


def test_a_build_cut_by_its_clock_ends_on_the_lowest_learning_rate() -> None:
    """The rate decays over the time budget when it ends before the steps: the last SmolLM2 build
    (2,000-step schedule, 384 steps in its 30 minutes) ran its whole budget at 95-100% of the peak."""
    from fedge.zoo.training import lr_at

    budget = DraftSpec(steps=4000, warmup_steps=20).budget()
    floor = budget.lr * budget.min_lr_ratio
    assert lr_at(384, budget) > 0.95 * budget.lr  # by steps alone: barely started
    assert lr_at(384, budget, time_used=1.0) == pytest.approx(floor)
    assert lr_at(384, budget, time_used=0.5) == pytest.approx((budget.lr + floor) / 2)
    assert lr_at(4000, budget, time_used=0.1) == pytest.approx(floor)  # steps end first
    assert lr_at(5, budget, time_used=0.9) < budget.lr * 0.5  # warmup is by steps
