"""Draft realignment: a second federation distils the micro draft from the federated micro target."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from safetensors.torch import load_file

from fedge import keys
from fedge.lm import distill, holder
from fedge.models import load_causal_lm
from fedge.server.rundir import MetricsLog
from fedge.simulations.realign import acceptance_by_client, participating, realign_draft
from fedge.simulations.runner import load_scenario, run_simulation
from fedge.types import ConfigValue
from fedge.zoo import ZooPaths
from fedge.zoo.evaluate import greedy_agreement, prompts_from


@pytest.fixture(scope="module")
def realigned(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One round of the quick federation on the target, then one round realigning the draft.

    The in-process engine runs the same ServerApp and ClientApp without Ray's start-up cost.
    """
    root = tmp_path_factory.mktemp("realign")
    scenario = replace(load_scenario("quick", {"num-server-rounds": 1}), engine="inprocess")
    outcome = run_simulation(scenario, root / "target")
    assert outcome.status == "completed", outcome.message
    teacher = root / "target" / "final" / "merged"
    merged = realign_draft(scenario, micro_zoo.draft_dir, teacher, root / "draft")
    return {"target_run": root / "target", "draft_run": root / "draft", "merged": merged}


def test_clients_train_the_draft_on_kl_to_the_federated_target(
    realigned: dict[str, Path], micro_zoo: ZooPaths
) -> None:
    """The second federation trains the draft against the federated target; its LoRA is merged.

    Cross-entropy of a barely trained micro model is ~5; its KL to the target is far smaller.
    """
    ce = MetricsLog(realigned["target_run"]).rows()[-1]["train_loss"]
    kl = MetricsLog(realigned["draft_run"]).rows()[-1]["train_loss"]
    assert ce > 4.0 and 0.0 <= kl < 2.0, (ce, kl)
    config = tomllib.loads((realigned["draft_run"] / "config.toml").read_text())
    assert Path(config["model"]) == micro_zoo.draft_dir
    assert Path(config["distill-teacher"]) == realigned["target_run"] / "final" / "merged"
    # merged = base + (alpha / r) B A, with the federation's final adapter, on every layer
    adapter_dir = realigned["draft_run"] / "final" / "adapter"
    lora = json.loads((adapter_dir / "adapter_config.json").read_text())
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    base = load_causal_lm(micro_zoo.draft_dir).state_dict()
    moved = load_causal_lm(realigned["merged"]).state_dict()
    prefix = "base_model.model."
    merged_layers = 0
    for name in adapter:
        if name.endswith("lora_A.weight"):
            weight = name[len(prefix) : -len("lora_A.weight")] + "weight"
            delta = adapter[name.replace("lora_A", "lora_B")] @ adapter[name]
            expected = base[weight] + lora["lora_alpha"] / lora["r"] * delta
            torch.testing.assert_close(moved[weight], expected, atol=1e-6, rtol=1e-5)
            assert not torch.equal(moved[weight], base[weight]), weight
            merged_layers += 1
    assert merged_layers == 7 * load_causal_lm(micro_zoo.draft_dir).config.num_hidden_layers


def test_acceptance_is_measured_per_participating_client(
    realigned: dict[str, Path], micro_zoo: ZooPaths
) -> None:
    """Each row holds, for its own client's held-out prompts, the three pairs' greedy agreement."""
    clients = participating(realigned["draft_run"])
    assert clients == [0, 1, 2]  # the quick federation trains all three partitions
    models = {
        "base_target": micro_zoo.target_dir,
        "federated_target": realigned["target_run"] / "final" / "merged",
        "base_draft": micro_zoo.draft_dir,
        "realigned_draft": realigned["merged"],
    }
    config = load_scenario("quick").config
    corpus = holder.get_corpus(
        {**config.client_config(), keys.CFG_MODEL_PATH: str(micro_zoo.target_dir)}
    )
    # The federated target barely moved in one short round: its agreements can equal the base
    # target's. With the roles given models that differ (the draft as "federated target": it
    # agrees with itself everywhere) the three figures differ, so a swapped pair shows.
    distinct = {
        "base_target": micro_zoo.target_dir,
        "federated_target": micro_zoo.draft_dir,
        "base_draft": micro_zoo.draft_dir,
        "realigned_draft": micro_zoo.target_dir,
    }
    for roles in (models, distinct):
        rows = acceptance_by_client(
            config, clients, roles, prompts=2, new_tokens=4, prompt_tokens=4
        )
        assert [r.partition for r in rows] == clients
        loaded = {name: load_causal_lm(path).eval() for name, path in roles.items()}
        for row in rows:
            heldout = np.asarray(corpus.client(row.partition).heldout)
            picks = prompts_from(heldout[: len(heldout) - 4], 2, 4)

            def rate(
                target: str, draft: str, picks: list[np.ndarray] = picks, loaded: dict = loaded
            ) -> float:
                return greedy_agreement(loaded[target], loaded[draft], picks, 4).rate

            assert row.base == rate("base_target", "base_draft")
            assert row.drifted == rate("federated_target", "base_draft")
            assert row.realigned == rate("federated_target", "realigned_draft")
            if roles is distinct:
                assert row.drifted == 1.0 and len({row.base, row.drifted, row.realigned}) == 3


def test_teacher_batches_keep_the_prompt_and_follow_the_teachers_greedy_path(
    micro_zoo: ZooPaths,
) -> None:
    """Sequence-level KD rows: the window's head, then exactly what target.generate would say."""
    teacher = str(micro_zoo.target_dir)
    windows = [torch.randint(2, 1000, (3, 17)), torch.randint(2, 1000, (2, 17))]
    config: dict[str, ConfigValue] = {"distill-teacher": teacher, "distill-generate": 6}
    out = distill.teacher_batches(config, windows)
    assert [tuple(b.shape) for b in out] == [(3, 17), (2, 17)]
    model = distill.teacher_model(teacher)
    for window, row in zip(torch.cat(windows), torch.cat(out), strict=True):
        assert torch.equal(row[:11], window[:11])
        expected = model.generate(  # type: ignore[operator]
            window[None, :11], max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
        )[0]
        assert torch.equal(row, expected)
    assert distill.teacher_batches({"distill-teacher": teacher}, windows) is windows
    with pytest.raises(ValueError, match=r"generate=16 must be > 0 and leave a prompt"):
        distill.teacher_batches({**config, "distill-generate": 16}, windows)
    with pytest.raises(ValueError, match=r"distill-generate must be >= 0"):
        distill.teacher_batches({**config, "distill-generate": -1}, windows)


def test_bad_teacher_and_dpsgd_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"distill-teacher=.* is not a model directory"):
        distill.batch_loss({"distill-teacher": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match=r"distill-temperature must be > 0"):
        distill.batch_loss({"distill-teacher": "x", "distill-temperature": 0.0})
    with pytest.raises(ValueError, match=r"distill-teacher with DP-SGD is not supported"):
        distill.refuse_dpsgd({"distill-teacher": str(tmp_path)})
    assert distill.batch_loss({}) is distill.lm_batch_loss
