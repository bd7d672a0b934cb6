"""`fedge demo --preset smollm2`'s wiring on a tiny model the test writes (the micro zoo's target
with a chat template): code-instruction streams, response-only loss and perplexity, the preset's
federation; the real SmolLM2 runs in `make test-pretrained` only."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedge.data.instructions import build_instruction_corpus, heldout_prompts
from fedge.edge.demo import EdgeSizes
from fedge.lm.config import TrainConfig
from fedge.lm.evaluate import eval_windows, evaluate_tokens, lm_batch_loss, split_window
from fedge.manifest import write_manifest
from fedge.models import load_causal_lm, load_tokenizer
from fedge.server.rundir import MetricsLog
from fedge.simulations.demo import federated_stage
from fedge.simulations.demo_presets import SMOLLM2
from fedge.zoo import ZooPaths

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}[end]\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]\n{% endif %}"
)
SLOT = 128
CHARS = 60_000  # per package: enough for a few clients with held-out examples


@pytest.fixture(scope="module")
def tiny(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The micro target with a chat template, as a folder with its own manifest."""
    out = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(micro_zoo.target_dir, out)
    tokenizer = load_tokenizer(out)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    write_manifest(out)
    return out


@pytest.fixture(scope="module")
def corpus(tiny: Path):  # type: ignore[no-untyped-def]
    """Built where the federation's clients and server look for it (built once)."""
    return build_instruction_corpus(tiny, SLOT, CHARS)


def test_each_slot_is_one_example_its_prompt_input_only(tiny: Path, corpus) -> None:  # type: ignore[no-untyped-def]
    """A disjoint held-out window is one example from its start; only its response is a target."""
    tokenizer = load_tokenizer(tiny)
    assert len(corpus) >= 2
    for position in range(len(corpus)):
        heldout = np.asarray(corpus.client(position).heldout)
        assert len(heldout) % SLOT == 0
        for window in eval_windows(heldout, SLOT, 4):
            inputs, targets = split_window(window)
            text = tokenizer.decode(inputs[0].tolist())
            assert text.startswith("[user]\ndef ") or text.startswith("[user]\nasync def ")
            scored = targets[0][targets[0] >= 0].tolist()
            assert scored  # every slot holds part of a response
            # the targets are the response that follows the generation prompt, nothing before it
            answer = text.split("[assistant]\n", 1)[1]
            assert answer.startswith(tokenizer.decode(scored[: len(scored) // 2]))


def test_the_loss_is_the_responses_alone(micro_zoo: ZooPaths, corpus) -> None:  # type: ignore[no-untyped-def]
    model = load_causal_lm(micro_zoo.target_dir).eval()
    batch = torch.from_numpy(np.asarray(corpus.client(0).train[: 2 * SLOT]).astype(np.int64))
    batch = batch.reshape(2, SLOT)
    inputs, targets = split_window(batch)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
        mask = targets >= 0
        expected = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        unmasked = lm_batch_loss(model, torch.where(batch < 0, torch.bitwise_not(batch), batch))
        assert float(lm_batch_loss(model, batch)) == pytest.approx(float(expected), rel=1e-5)
        # a window of prompt tokens only scores nothing: 0, not NaN
        prompt_only = torch.bitwise_not(inputs[:, :8].abs())
        assert float(lm_batch_loss(model, prompt_only)) == 0.0
    assert not math.isclose(float(expected), float(unmasked), rel_tol=1e-2)


def test_the_preset_federation_scores_held_out_responses(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The smollm2 scenario on the tiny model: the server's round-0 participants' perplexity is
    the base model's loss on the participants' held-out responses (the prompt never scored)."""
    from rich.console import Console

    from fedge.lm import holder
    from fedge.simulations.runner import scenario_path

    # the preset's scenario with as many nodes as the tiny corpus has clients
    text = scenario_path(SMOLLM2.scenario).read_text()
    scenario = tmp_path / "smollm2-tiny.toml"
    scenario.write_text(
        text.replace("num-supernodes = 6", "num-supernodes = 2")
        .replace("min-available-nodes = 6", "min-available-nodes = 2\nmin-train-nodes = 2")
        .replace("min-train-nodes = 4\n", "")
    )
    monkeypatch.setenv(
        "FEDGE_DEMO_SET",
        f"num-server-rounds=1 local-steps=1 batch-size=2 seq-len={SLOT} server-eval-batches=6 "
        f"eval-batches=1 max-chars-per-client={CHARS} lora-target-modules=q_proj,v_proj "
        "precision=fp32",
    )
    result = federated_stage(
        tiny, tmp_path / "fed", Console(quiet=True), scenario_name=str(scenario)
    )
    rows = [r for r in MetricsLog(tmp_path / "fed").rows() if r.get("perplexity") is not None]
    cfg = TrainConfig(seq_len=SLOT, eval_batches=6, precision="fp32")
    config = {"model": str(tiny), "data-kind": "instructions", "seq-len": SLOT}
    corpus = holder.get_corpus({**config, "max-chars-per-client": CHARS})
    heldout = np.concatenate([np.asarray(corpus.client(p).heldout) for p in result.partitions])
    model = load_causal_lm(tiny)
    loss, scored = evaluate_tokens(model, heldout, cfg, torch.device("cpu"))
    assert rows[0]["participants_eval_loss"] == pytest.approx(loss, rel=1e-4)
    assert scored < 6 * SLOT  # targets only, not every position of the six windows
    assert (result.adapter_dir / "adapter_config.json").is_file()


def test_held_out_instructions_for_the_edge_are_prompts_and_their_true_bodies(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    examples = heldout_prompts(tokenizer, 3, 80, 8, max_chars_per_client=CHARS)
    assert len(examples) == 3
    for e in examples:
        prompt = tokenizer.decode(e.prompt_ids)
        assert prompt == f"[user]\n{e.instruction}[end]\n[assistant]\n"
        assert len(e.prompt_ids) <= 80 and len(e.response_ids) >= 8


def test_the_preset_keeps_every_size_in_its_config() -> None:
    """The smollm2 federation's sizes come from its scenario; DP stays within epsilon 8's noise."""
    from fedge.simulations.runner import load_scenario

    scenario = load_scenario(SMOLLM2.scenario, {"model": "unused"})
    assert scenario.config.data_kind == "instructions"
    assert scenario.num_supernodes == 6
    assert SMOLLM2.private["dp-noise-multiplier"] >= 1.5
    assert replace(SMOLLM2, draft_minutes=1.0).draft_minutes == 1.0


@pytest.mark.pretrained
@pytest.mark.timeout(3600)
def test_the_smollm2_preset_runs_every_stage_at_a_smoke_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real SmolLM2 (fetched when missing), a draft built in half a minute of distillation,
    one round of one step per federation, one edge prompt: every stage, the summary and report."""
    from rich.console import Console

    from fedge.cli.demo import run_pretrained_demo

    monkeypatch.setenv(
        "FEDGE_DEMO_SET",
        "num-server-rounds=1 local-steps=1 batch-size=2 server-eval-batches=4 eval-batches=1",
    )
    demo = replace(
        SMOLLM2,
        draft_minutes=0.5,
        edge=EdgeSizes(validation_prompts=2, prompts=1, new_tokens=8, sample_tokens=8),
    )
    run = tmp_path / "run"
    summary = run_pretrained_demo(demo, run, Console(), draft=tmp_path / "draft")
    stages = summary["stages"]
    assert stages["draft"]["cached"] is False and (tmp_path / "draft" / "config.json").is_file()
    plain, private = stages["federation"]["plain"], stages["federation"]["private"]
    assert all(math.isfinite(x) for x in plain["participating_perplexity"])
    assert private["epsilon"] is not None and private["epsilon"] <= 8
    assert "skipped" in stages["realignment"]
    edge = stages["edge"]
    assert edge["greedy_identical"]
    assert edge["showcase"]["instruction"] and edge["showcase"]["prompt"].lstrip().startswith(
        ("def ", "async def ")
    )
    assert "## 6. Edge" in (run / "report.md").read_text()
    assert (run / "demo_summary.json").is_file()
