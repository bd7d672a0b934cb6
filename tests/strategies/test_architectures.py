"""Any Hugging Face causal LM federates with the default LoRA targets ("auto").

Small random-weight Llama, Qwen2, Mistral, GPT-2, Phi-3 and Gemma models, written with
transformers' own config classes (the micro zoo's tokenizer beside them), each run one
round of the real fedge federation (ServerApp + ClientApp, in-process grid, two nodes
on a few KB of text). Before ``auto``, the default ``q_proj,k_proj,v_proj,o_proj`` made
the GPT-2 federation fail (no such module) and adapted only Phi-3's ``o_proj``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.clientapp import ClientApp

from fedge.server.app import OutcomeBox, make_server_app
from fedge.server.config import RunConfig
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.simulations.runner import client_roots
from tests.architectures import ARCHITECTURES, model_dir, write_text
from tests.simulations.federations import TINY_TRAINING


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few KB of text as the federation's data source."""
    return write_text(tmp_path_factory.mktemp("text"))


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_one_federation_round_with_auto_lora_targets(
    name: str, micro_zoo, text_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The round completes, the adapter moved, and exactly the expected modules were adapted."""
    from fedge.clients import app as deployed
    from fedge.lm import holder

    model = model_dir(name, tmp_path, micro_zoo)
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
    """Every run tracks its rounds in TensorBoard by default (fedge.server.tracking)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    assert [e.step for e in events.Scalars("round/eval_loss")] == rounds
