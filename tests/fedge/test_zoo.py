"""The built-in zoo: tokenizer round trip, determinism, loading, manifests and the model card."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedge.errors import CorruptModelError, ModelNotFoundError
from fedge.manifest import MANIFEST_NAME, verify_manifest
from fedge.models import load_causal_lm, load_tokenizer
from fedge.zoo import ZooPaths, ensure_zoo, get_preset, zoo_problems
from fedge.zoo.tokenizer import save_tokenizer


def test_tokenizer_round_trips_code_and_unicode(micro_zoo: ZooPaths) -> None:
    tokenizer = load_tokenizer(micro_zoo.target_dir)
    text = 'def f(x: int) -> str:\n    """Grüße, 世界"""\n\treturn f"{x!r}"  # ☃\n'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merged something
    assert load_tokenizer(micro_zoo.draft_dir).get_vocab() == tokenizer.get_vocab()


def test_a_tokenizer_saves_the_same_bytes_whichever_way_it_was_loaded(
    micro_zoo: ZooPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded online or offline, the zoo's tokenizer writes identical files. Before, its config
    recorded `local_files_only`, so a zoo built with HF_HUB_OFFLINE set (as `make test` builds
    it) differed from one built without, and the rebuild-equals-cache test failed."""
    from transformers import PreTrainedTokenizerFast, tokenization_utils_base

    for offline in (False, True):  # the hub's offline mode as transformers reads it
        monkeypatch.setattr(tokenization_utils_base, "is_offline_mode", lambda o=offline: o)
        loaded = PreTrainedTokenizerFast.from_pretrained(
            micro_zoo.target_dir, local_files_only=offline
        )
        save_tokenizer(loaded, tmp_path / str(offline))
    files = sorted(p.name for p in (tmp_path / "True").iterdir())
    assert "tokenizer_config.json" in files
    for name in files:
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes()


def test_built_dirs_load_with_from_pretrained(micro_zoo: ZooPaths) -> None:
    from transformers import AutoModelForCausalLM

    preset = get_preset("micro")
    target = AutoModelForCausalLM.from_pretrained(micro_zoo.target_dir)
    draft = load_causal_lm(micro_zoo.draft_dir)
    assert target.config.num_hidden_layers == preset.target.layers
    assert draft.config.hidden_size == preset.draft.hidden
    ids = torch.tensor([[5, 6, 7]])
    assert target(input_ids=ids).logits.shape == (1, 3, preset.vocab_size)


def test_model_card_reports_the_figures(micro_zoo: ZooPaths) -> None:
    """Every measured figure of the card is re-measured here on the saved models and corpus."""
    from fedge.data.corpus import split_sources, stdlib_sources
    from fedge.zoo.build import PROMPT_TOKENS
    from fedge.zoo.evaluate import greedy_agreement, perplexity, prompts_from

    card, preset = micro_zoo.card, get_preset("micro")
    tokenizer = load_tokenizer(micro_zoo.target_dir)
    files = stdlib_sources(max_chars_per_label=preset.max_chars_per_label)
    encoded = tokenizer([f.text for f in split_sources(files)[1]], add_special_tokens=False)
    heldout = np.fromiter(
        (t for ids in encoded["input_ids"] for t in [*ids, tokenizer.eos_token_id]), np.uint16
    )
    assert card["corpus"]["files"] == len(files)
    assert card["corpus"]["heldout_tokens"] == len(heldout)
    assert card["tokenizer"]["vocab_size"] == len(tokenizer) == preset.vocab_size
    models = {
        "target": load_causal_lm(micro_zoo.target_dir),
        "draft": load_causal_lm(micro_zoo.draft_dir),
    }
    for role, model in models.items():
        budget = getattr(preset, f"{role}_train")
        assert card[role]["parameters"] == sum(p.numel() for p in model.parameters())
        assert card[role]["training_steps"] == budget.steps
        assert card[role]["training_tokens"] == budget.steps * budget.batch_size * preset.context
        with torch.no_grad():
            measured = perplexity(model, heldout, preset.context, preset.eval_windows)
        assert card[role]["heldout_perplexity"] == pytest.approx(measured, abs=2e-3)
    prompts = prompts_from(heldout, preset.agreement_prompts, PROMPT_TOKENS)
    agreement = greedy_agreement(
        models["target"], models["draft"], prompts, preset.agreement_tokens
    )
    assert card["agreement"]["greedy_rate"] == pytest.approx(agreement.rate, abs=1e-4)
    assert card["agreement"]["tokens_per_verify_draft4"] == pytest.approx(
        agreement.tokens_per_verify, abs=1e-3
    )
    assert card["agreement"]["positions"] == preset.agreement_prompts * preset.agreement_tokens
    # Trained models beat a uniform guess over the vocabulary.
    assert card["target"]["heldout_perplexity"] < card["tokenizer"]["vocab_size"]


def _copy_zoo(source: ZooPaths, destination: Path) -> ZooPaths:
    import shutil

    shutil.copytree(source.root, destination)
    return ZooPaths(destination)


def test_truncated_weights_are_detected_and_refused(micro_zoo: ZooPaths, tmp_path: Path) -> None:
    copy = _copy_zoo(micro_zoo, tmp_path / "zoo")
    weights = copy.target_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert any("model.safetensors" in p for p in verify_manifest(copy.target_dir))
    assert zoo_problems(copy)
    with pytest.raises(CorruptModelError, match=r"model\.safetensors"):
        load_causal_lm(copy.target_dir)


def test_unknown_model_id_offline_says_how_to_fix() -> None:
    with pytest.raises(ModelNotFoundError, match="fedge models build"):
        load_causal_lm("no-such-org/no-such-model")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_causal_lm("./missing/model/dir")


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="micro"):
        get_preset("huge")


@pytest.fixture(scope="module")
def killed_then_damaged(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> ZooPaths:
    """A real micro build killed (SIGKILL) once the target's first checkpoint exists, then
    damaged as a finished zoo can be (a card, a draft directory whose config.json no longer
    matches its manifest) and handed to `ensure_zoo`, which repairs it in this process.

    One build serves both tests below: the draft is trained after the resume either way, so
    damaging it costs nothing, where a separate repair of a damaged copy retrained it again
    (7 CPU s). Every stage runs from scratch in one of the two processes (tokenizer and the
    first target steps in the killed one, the rest of the target from its checkpoint and the
    whole draft after the repair)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from fedge.simulations.localnet import wait_for_file

    out = tmp_path_factory.mktemp("killed") / "zoo"
    command = [sys.executable, "-m", "fedge.cli", "models", "build", "--preset", "micro"]
    process = subprocess.Popen(
        [*command, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    checkpoint = out / ".build" / "target.pt"
    try:
        wait_for_file(checkpoint, process, timeout=600, poll_s=0.05)
    finally:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert checkpoint.is_file() and not (out / "model_card.json").exists()
    assert not (out / "target").exists(), "killed after the target was saved: nothing to resume"

    damaged = ZooPaths(out)
    shutil.copy(micro_zoo.card_path, damaged.card_path)
    shutil.copytree(micro_zoo.draft_dir, damaged.draft_dir)
    (damaged.draft_dir / "config.json").write_text("{}")
    assert zoo_problems(damaged)
    return ensure_zoo("micro", out)


def test_damaged_zoo_is_rebuilt_not_used(killed_then_damaged: ZooPaths) -> None:
    assert zoo_problems(killed_then_damaged) == []
    draft_config = json.loads((killed_then_damaged.draft_dir / "config.json").read_text())
    assert draft_config["hidden_size"] == get_preset("micro").draft.hidden


def test_killed_build_resumes_to_the_same_weights(
    micro_zoo: ZooPaths, killed_then_damaged: ZooPaths
) -> None:
    """The killed, damaged and repaired build equals the cached micro zoo, byte for byte: the
    resume is exact, and so (every stage having run from scratch) builds are deterministic."""
    for role in ("target", "draft"):
        first = json.loads((getattr(micro_zoo, f"{role}_dir") / MANIFEST_NAME).read_text())
        second = json.loads(
            (getattr(killed_then_damaged, f"{role}_dir") / MANIFEST_NAME).read_text()
        )
        assert first["files"] == second["files"], role
