"""DP-SGD and SecAgg+ federate GPT-2 and Phi-3 (the other four: `make test-archs`) with "auto" LoRA targets.

GPT-2 adapts a Conv1D (`c_attn`) and Phi-3 fused projections (`qkv_proj`, `gate_up_proj`):
the shapes that differ most from Llama's. Each runs one round of the real fedge federation
(ServerApp + the deployed ClientApp behind fedge's mods, in-process grid, three nodes) with
Opacus DP-SGD on every client, or with the SecAgg+ aggregator, and must complete with a
moved adapter and its privacy figures reported; under SecAgg+ the server's grid records
every reply, and only keys, masked inputs and shares reached it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.secagg import wire
from fedge.server.app import OutcomeBox, make_server_app
from fedge.server.config import RunConfig
from fedge.server.rundir import MetricsLog
from fedge.server.secagg.aggregator import MASKED_RECORD
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.simulations.runner import client_roots
from tests.architectures import model_dir, write_text
from tests.privacy.test_matrix import MODES
from tests.simulations.federations import TINY_TRAINING, RecordingGrid, client_app

NODES = 3
OTHERS = ("gemma", "llama", "mistral", "qwen2")  # `make test-archs` only


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few KB of text per node as the federation's data source."""
    return write_text(tmp_path_factory.mktemp("text"), NODES)


@pytest.mark.parametrize("mode", ["dp-sgd", "secagg"])
@pytest.mark.parametrize(
    "name",
    ["gpt2", "phi3", *(pytest.param(n, marks=pytest.mark.archs) for n in OTHERS)],
)
def test_one_private_federation_round(
    name: str, mode: str, micro_zoo, text_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from fedge.lm import holder

    model = model_dir(name, tmp_path, micro_zoo)
    settings: dict[str, Any] = {
        "model": str(model),
        "data-source": str(text_dir),
        "num-server-rounds": 1,
        **TINY_TRAINING,
        "min-train-nodes": NODES,
        "min-available-nodes": NODES,
        "run-dir": str(tmp_path / "run"),
        "precision": "fp32",
        "lr": 0.05,
        **MODES[mode],
    }
    cfg = RunConfig.from_mapping(settings)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "node-state"))  # DP-SGD ledgers
    box = OutcomeBox()
    with client_roots(cfg):
        grid = RecordingGrid(InProcessGrid(client_app(), DeviceTable(NODES), tmp_path / "state"))
        run_inprocess(make_server_app(cfg, box=box), grid)  # type: ignore[arg-type]

    assert box.outcome is not None and box.outcome.status == "completed", box.outcome
    adapter = box.outcome.state.adapter  # type: ignore[union-attr]
    initial = holder.get_lora_model(str(model), cfg.train).initial
    assert any(not np.array_equal(adapter[k], initial[k]) for k in adapter)
    (row,) = [r for r in MetricsLog(box.outcome.run_dir).rows() if r["round"] == 1]
    assert row["status"] == "ok" and row["clients_succeeded"] == NODES
    if mode == "dp-sgd":
        assert row["dp_sgd_epsilon"] > 0  # every client's Opacus accountant spent budget
    else:
        assert row["dp_sgd_epsilon"] is None
        _assert_masked(grid.replies)


def _assert_masked(replies: list[Message]) -> None:
    """SecAgg+ ran: every node advertised keys, sent a masked input and its shares, and no
    train reply carried a contribution in the clear."""
    trains = [m for m in replies if m.metadata.message_type == "train"]
    assert all(keys.REC_CONTRIB not in m.content.array_records for m in trains)
    stages = Counter(
        str(m.content.config_records[wire.SECAGG_RECORD][wire.KEY_STAGE]) for m in trains
    )
    assert stages == {stage: NODES for stage in wire.STAGES}
    collected = [m for m in trains if MASKED_RECORD in m.content.array_records]
    assert len(collected) == NODES
