"""SecAgg+ and DP aggregators over real Flower messages (one run on the in-process engine).

A tiny ClientApp answers train messages with a known contribution per partition, so the
test can compare the unmasked sums with the plain sum and inspect every reply the
ServerApp received. All aggregators run in one ServerApp, one after another.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.privacy.wire import MET_DP_TRAIN_LOSS
from fedge.secagg.config import SecAggConfig
from fedge.server.aggregation import PlainAggregator
from fedge.server.grid import ReplyHookGrid
from fedge.server.privacy.aggregators import CentralDPAggregator, DistributedDPAggregator
from fedge.server.privacy.config import DPConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from tests.secagg.harness import CRASH_KEY, known_client_app, partition_ids, simulate

NUM_NODES = 5
SIZE = 3000
RESULTS: dict[str, Any] = {}


def true_contribution(pid: int) -> dict[str, np.ndarray]:
    """The contribution partition `pid` sends: known to the test, never to the server."""
    rng = np.random.default_rng(100 + pid)
    return {
        "delta/w.lora_B": rng.normal(0, 0.02, size=(SIZE // 2,)).astype(np.float32),
        "ctrl/w.lora_B": rng.normal(0, 0.02, size=(SIZE // 2,)).astype(np.float32),
        "delta/w.lora_A": np.zeros(SIZE // 2, np.float32),  # FFA-LoRA: A is frozen
        "meta/weight": np.array([1.0], np.float32),
        "meta/count": np.array([1.0], np.float32),
    }


def train_loss(pid: int) -> float:
    """The train loss partition `pid` reports."""
    return 1.5 + pid


SPEC = {k: tuple(v.shape) for k, v in true_contribution(0).items()}


class RecordingGrid(ReplyHookGrid):
    """Delegates to Flower's grid and keeps every reply the ServerApp receives."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.received: list[RecordDict] = []

    def on_reply(self, msg: Message) -> Message:
        if msg.has_content():
            self.received.append(msg.content)
        return msg


def main(grid: Grid) -> None:
    """Run every aggregator once over the same nodes; stash results for the test."""
    RESULTS["pid"] = partition_ids(grid, NUM_NODES)
    nodes = sorted(RESULTS["pid"])

    def content(mods: str = "") -> RecordDict:
        return RecordDict({keys.REC_CONFIG: ConfigRecord({keys.CFG_CLIENT_MODS: mods})})

    secagg_cfg = SecAggConfig(num_shares=1.0, reconstruction_threshold=3, stage_timeout_s=30)
    rec = RecordingGrid(grid)
    RESULTS["secagg"] = SecAggPlusAggregator(secagg_cfg).aggregate(
        rec, 1, nodes, content(), SPEC, 60
    )
    RESULTS["secagg_seen"] = rec.received
    RESULTS["plain"] = PlainAggregator().aggregate(grid, 2, nodes, content(), SPEC, 60)
    # One client crashes while training: 3 of a survivor's 4 neighbours still rebuild its mask
    crash = content()
    crash[keys.REC_CONFIG][CRASH_KEY] = "3"
    RESULTS["drop1"] = SecAggPlusAggregator(secagg_cfg).aggregate(grid, 3, nodes, crash, SPEC, 60)
    # Two crash: below the threshold, the round must fail with no sum
    crash[keys.REC_CONFIG][CRASH_KEY] = "0,3"
    failing = SecAggPlusAggregator(secagg_cfg)
    RESULTS["drop2"] = failing.aggregate(grid, 4, nodes, crash, SPEC, 60)
    RESULTS["drop2_message"] = failing.last_failure
    dp = DPConfig(mode="central", clip_norm=0.01, noise_multiplier=1.0)
    RESULTS["central"] = CentralDPAggregator(PlainAggregator(), dp).aggregate(
        grid, 5, nodes, content(), SPEC, 60
    )
    ddp = DPConfig(mode="distributed", clip_norm=0.01, noise_multiplier=1.0, min_survival=0.6)
    rec = RecordingGrid(grid)
    RESULTS["ddp"] = DistributedDPAggregator(SecAggPlusAggregator(secagg_cfg), ddp).aggregate(
        rec, 6, nodes, content(), SPEC, 60
    )
    RESULTS["ddp_seen"] = rec.received


def _run_once() -> dict[str, Any]:
    if not RESULTS:
        with tempfile.TemporaryDirectory() as root, pytest.MonkeyPatch.context() as mp:
            mp.setenv(STATE_DIR_ENV, root)  # identity keys and ledgers of this run only
            simulate(main, known_client_app(true_contribution, train_loss), NUM_NODES)
    return RESULTS


def plain_sum(pids: Iterable[int]) -> dict[str, np.ndarray]:
    parts = [true_contribution(p) for p in pids]
    return {k: sum(p[k].astype(np.float64) for p in parts) for k in SPEC}


def bound(n: int) -> float:
    cfg = SecAggConfig()
    return n * 2 * cfg.clipping_range / cfg.quantization_range


def test_secagg_sum_over_flower_messages_equals_the_plain_sum() -> None:
    # Prepare / Execute
    res = _run_once()
    secagg, plain = res["secagg"], res["plain"]
    # Assert
    assert secagg.summed is not None and plain.summed is not None
    assert sorted(secagg.accepted) == sorted(plain.accepted) == sorted(res["pid"])
    for k in SPEC:
        assert np.max(np.abs(secagg.summed[k] - plain.summed[k])) <= bound(NUM_NODES) + 1e-6
    # the clients' train losses reach the server only as their sum
    assert secagg.metrics == {}
    want = sum(1.5 + p for p in range(NUM_NODES))
    assert secagg.summed_metrics[keys.MET_TRAIN_LOSS] == pytest.approx(want, abs=0.01)


def test_server_never_holds_an_individual_update_or_metric() -> None:
    # Prepare
    res = _run_once()
    truths = [true_contribution(p) for p in range(NUM_NODES)]
    # Execute: everything the ServerApp received in the SecAgg+ and SecAgg+ DDP rounds
    seen = res["secagg_seen"] + res["ddp_seen"]
    # Assert: no plain contribution record or client metric; no array correlates with any input
    assert seen, "the recording grid saw no replies"
    for content in seen:
        assert keys.REC_CONTRIB not in content.array_records
        assert not content.metric_records  # metrics travel summed inside the masked vector
        for record in content.array_records.values():
            for name, arr in record.items():
                values = arr.numpy().astype(np.float64).reshape(-1)
                for truth in truths:
                    if name in truth and truth[name].size > 100 and truth[name].std() > 0:
                        assert abs(np.corrcoef(values, truth[name])[0, 1]) < 0.15
        for record in content.config_records.values():
            for value in record.values():
                blobs = value if isinstance(value, list) else [value]
                for blob in blobs:
                    if isinstance(blob, bytes):
                        assert all(t["delta/w.lora_B"].tobytes()[:32] not in blob for t in truths)


def test_dropouts_at_threshold_give_the_survivors_exact_sum() -> None:
    # Prepare / Execute
    res = _run_once()
    result = res["drop1"]
    by_node = res["pid"]
    # Assert: partition 3 crashed; the sum is exactly the other four's
    assert result.summed is not None
    survivors = sorted(by_node[n] for n in result.accepted)
    assert survivors == [0, 1, 2, 4]
    want = plain_sum(survivors)
    for k in SPEC:
        assert np.max(np.abs(result.summed[k] - want[k])) <= bound(4) + 1e-6


def test_below_threshold_the_round_fails_with_no_partial_aggregate() -> None:
    res = _run_once()
    assert res["drop2"].summed is None
    assert "no aggregate is applied" in res["drop2_message"]


def test_central_dp_clips_and_noises_over_flower_messages() -> None:
    # Prepare
    res = _run_once()
    summed = res["central"].summed
    # Assert: noise of std z C = 0.01 around a sum of 5 contributions clipped to norm 0.01
    assert summed is not None
    noise = np.concatenate([summed["delta/w.lora_B"], summed["ctrl/w.lora_B"]]).astype(np.float64)
    assert 0.008 < noise.std() < 0.012  # each clipped contribution adds ~0.01/sqrt(3000) per value
    assert summed["meta/count"][0] == 5.0
    assert not np.any(summed["delta/w.lora_A"])  # FFA-LoRA: frozen A gets no noise, stays put


def test_distributed_dp_sum_carries_the_full_noise() -> None:
    # Prepare
    res = _run_once()
    summed = res["ddp"].summed
    # Assert: 5 clients each add std 0.01/sqrt(3): the sum's std is 0.01*sqrt(5/3)
    assert summed is not None
    values = np.concatenate([summed["delta/w.lora_B"], summed["ctrl/w.lora_B"]])
    assert math.isclose(float(values.std()), 0.01 * math.sqrt(5 / 3), rel_tol=0.1)
    assert abs(float(summed["meta/count"][0]) - 5.0) < bound(5)
    # clear metric sums would carry none of the noise: only the loss the DP mod noised (k z)
    assert set(res["ddp"].summed_metrics) == {MET_DP_TRAIN_LOSS}
    # FFA-LoRA is on under DP: the frozen lora_A is neither noised nor uploaded
    assert not np.any(summed["delta/w.lora_A"])
    per_client_ddp = res["ddp"].bytes_up / len(res["ddp"].accepted)
    per_client_secagg = res["secagg"].bytes_up / len(res["secagg"].accepted)
    assert per_client_ddp < 0.75 * per_client_secagg
