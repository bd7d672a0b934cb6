"""Any Hugging Face causal LM federates with the default LoRA targets ("auto").

Small random-weight Llama, Qwen2, Mistral, GPT-2, Phi-3 and Gemma models, written with
transformers' own config classes (the micro zoo's tokenizer beside them), each run one
round of the real fedge federation (ServerApp + ClientApp, in-process grid, two nodes
on a few KB of text). Before ``auto``, the default ``q_proj,k_proj,v_proj,o_proj`` made
the GPT-2 federation fail (no such module) and adapted only Phi-3's ``o_proj``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers
from flwr.clientapp import ClientApp

from server.app import OutcomeBox, make_server_app
from server.config import RunConfig
from simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from simulations.runner import client_roots
from tests.simulations.federations import TINY_TRAINING

SMALL = {
    "vocab_size": 1024,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
}
DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
ARCHITECTURES = {
    # name: (config, LoRA-adapted module names "auto" must pick)
    "llama": (transformers.LlamaConfig(**SMALL, **DECODER), {"q_proj", "v_proj"}),
    "qwen2": (transformers.Qwen2Config(**SMALL, **DECODER), {"q_proj", "v_proj"}),
    "mistral": (transformers.MistralConfig(**SMALL, **DECODER), {"q_proj", "v_proj"}),
    "gemma": (transformers.GemmaConfig(**SMALL, **DECODER, head_dim=16), {"q_proj", "v_proj"}),
    "gpt2": (
        transformers.GPT2Config(
            vocab_size=1024,
            n_positions=64,
            n_embd=32,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        ),
        {"c_attn"},
    ),
    "phi3": (
        transformers.Phi3Config(**SMALL, **DECODER),
        {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    ),
}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few KB of text as the federation's data source."""
    root = tmp_path_factory.mktemp("text")
    source = Path(np.__file__).read_text()
    for i, client in enumerate(("a", "b")):
        (root / client).mkdir()
        (root / client / "text.txt").write_text(source[6000 * i : 6000 * (i + 1)])
    return root


def _model_dir(name: str, root: Path, micro_zoo) -> Path:  # type: ignore[no-untyped-def]
    """A random-weight model of the architecture, saved with the micro zoo's tokenizer."""
    config, _ = ARCHITECTURES[name]
    path = root / name
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(micro_zoo.target_dir / f, path / f)
    return path


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_one_federation_round_with_auto_lora_targets(
    name: str, micro_zoo, text_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The round completes, the adapter moved, and exactly the expected modules were adapted."""
    from clients import app as deployed
    from fedge.lm import holder

    model = _model_dir(name, tmp_path, micro_zoo)
    cfg = RunConfig.from_mapping(
        {
            "model": str(model),
            "data-source": str(text_dir),
            "num-server-rounds": 1,
            **TINY_TRAINING,
            "run-dir": str(tmp_path / "run"),
            "precision": "fp32",
            "lr": 0.05,
        }
    )
    assert cfg.train.lora_target_modules == "auto"
    app = ClientApp()
    app.query()(deployed.query)
    app.train()(deployed.train)
    box = OutcomeBox()
    with client_roots(cfg):  # the test runs every node: their roots hold its model and data
        run_inprocess(
            make_server_app(cfg, box=box), InProcessGrid(app, DeviceTable(2), tmp_path / "state")
        )
    assert box.outcome is not None and box.outcome.status == "completed", box.outcome
    adapter = box.outcome.state.adapter  # type: ignore[union-attr]
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapter}
    assert adapted == ARCHITECTURES[name][1]
    initial = holder.get_lora_model(str(model), cfg.train).initial
    assert any(not np.array_equal(adapter[k], initial[k]) for k in adapter)
    _assert_tensorboard_rounds(tmp_path / "run" / "tensorboard", [0, 1])


def _assert_tensorboard_rounds(logdir: Path, rounds: list[int]) -> None:
    """Every run tracks its rounds in TensorBoard by default (server.tracking)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    assert [e.step for e in events.Scalars("round/eval_loss")] == rounds
