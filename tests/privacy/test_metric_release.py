"""The training loss under DP: released noised and accounted, never in clear (issue 30 item 3).

Real Opacus DP-SGD on a tiny LoRA Llama (the loss release and its accounting), the
distributed-DP mod and SecAgg+ over real Flower messages through ``dispatch_mods`` on the
in-process grid, and a seeded random walk over policies and DP requests checking that no
reply carries a data-dependent metric in clear.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from opacus.accountants import RDPAccountant
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fedge import keys
from fedge.clients.privacy.dpsgd import DPSGDConfig, LossSum, cumulative_epsilon
from fedge.clients.privacy.ledger import Ledger
from fedge.clients.privacy.local import train_dpsgd_round
from fedge.clients.privacy.replies import PUBLIC_METRICS
from fedge.privacy.mechanism import noised_loss
from fedge.privacy.wire import MET_DP_TRAIN_LOSS
from fedge.secagg.config import SecAggConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.simulations.inprocess import InProcessGrid
from fedge.strategies.base import ClientHook
from tests.privacy.test_replies import DATA, SPEC, drive, make_grid, private_data

__all__ = ["make_grid"]  # the fixture, shared with test_replies

SEQ, BATCH, STEPS = 16, 8, 3


def tiny_lora() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_the_dpsgd_loss_is_noised_and_its_cost_is_in_the_ledger(tmp_path: Path) -> None:
    """The membership oracle of issue 30: on main a DP-SGD reply carried ``train-loss``, the
    mean of the un-noised step losses, beside a ``dp-sgd-epsilon`` that did not count it; the
    client holding a canary (a stream it fits at once: one repeated token) had the lower
    loss in every round. Here too the node-local losses show it (so the oracle is real);
    the reply now carries only ``dp-train-loss``, the noised per-step sums of clipped record
    losses (noise k z L, k = 3), and the ledger's epsilon is Opacus' RDP over
    (z / sqrt(1 + 1/k^2), q, steps) per round, above what the gradient steps alone cost."""
    canary = np.full(40 * (SEQ + 1), 7)  # the canary: one token repeated
    other = np.random.default_rng(0).integers(0, 64, size=40 * (SEQ + 1))
    dp = DPSGDConfig(noise_multiplier=1.0, max_grad_norm=0.5)
    kw = {"steps": STEPS, "batch_size": BATCH, "seq_len": SEQ, "lr": 0.5, "dp": dp}
    local: dict[str, list[float]] = {"canary": [], "other": []}
    released: list[float] = []
    for name, tokens in (("canary", canary), ("other", other)):
        model, ledger = tiny_lora(), Ledger(tmp_path / f"{name}.json")
        for _ in range(2):
            losses, metrics = train_dpsgd_round(
                model,
                tokens,
                hook=ClientHook(),
                ledger=ledger,
                **kw,  # type: ignore[arg-type]
            )
            local[name].append(float(np.nanmean(losses)))
            assert set(metrics) == {MET_DP_TRAIN_LOSS, "dp-sgd-epsilon", *_LOCAL}
            released.append(metrics[MET_DP_TRAIN_LOSS])
        # the ledger's epsilon counts the loss release: Opacus' RDP at z / sqrt(1 + 1/9), q = 1/5
        ref = RDPAccountant()
        ref.history = [(1.0 / math.sqrt(1 + 1 / 9), 0.2, STEPS)] * 2
        spent = cumulative_epsilon(ledger.load()["dp-sgd"], 1e-5)
        assert spent == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
        assert metrics["dp-sgd-epsilon"] == pytest.approx(spent)
        ref.history = [(1.0, 0.2, STEPS)] * 2
        assert spent > ref.get_epsilon(1e-5)
    assert all(c < o for c, o in zip(local["canary"], local["other"], strict=True))  # the oracle
    clear = local["canary"] + local["other"]
    assert all(r != pytest.approx(c, abs=1e-6) for r, c in zip(released, clear, strict=True))


_LOCAL = {"dp-sgd-sample-rate", "dp-sgd-records"}  # node diagnostics, cut by the reply filter


def test_the_loss_noise_has_the_accounted_standard_deviation() -> None:
    """Each step's loss sum gets N(0, (zL)^2) and each loss is clipped into [0, L]: 4000
    draws at z = 1.3, L = 2 over a batch whose losses (0.5, 3.0, -1.0) clip to 0.5 + 2 + 0
    give mean 2.5 and std 2.6 (bands of about 6 standard errors of each estimate: the noise
    is the OS's, not seeded)."""
    sums = []
    for _ in range(4000):
        acc = LossSum(clip=2.0, noise_multiplier=1.3)
        acc.add(torch.tensor([0.5, 3.0, -1.0]))
        sums.append(acc.total)
    assert np.mean(sums) == pytest.approx(2.5, abs=0.25)
    assert np.std(sums) == pytest.approx(2.6, rel=0.07)
    draws = [noised_loss(float("inf"), 4.0, 0.5) for _ in range(4000)]  # non-finite: L
    assert np.mean(draws) == pytest.approx(4.0, abs=0.05)
    assert np.std(draws) == pytest.approx(0.5, rel=0.05)


DDP = {"weighting": "uniform", "dp-clip-norm": 0.1, "dp-noise-std": 0.2, "dp-min-clients": 3}


def ledgers(root: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(root.glob("partition-*.json"))]


def test_distributed_dp_sums_the_noised_loss_and_records_it(
    make_grid: Callable[..., InProcessGrid], tmp_path: Path
) -> None:
    """Three nodes under require-dp, SecAgg+ with distributed DP. On main the loss stayed
    home (dropped; the server had no loss at all). Now each node releases its loss clipped
    to [0, 12] with std 3 x 0.2 x 12 / 0.1 (multiplier 3 z), summed inside the masked
    vector, and its ledger records two releases, z and 3 z (update and loss); the summed
    loss is off the clear sum by that noise (std 72 sqrt(3), never exactly the clear sum)."""
    grid = make_grid("require-dp = true\nmin-noise = 0.5\n", 3)

    def script(g: Grid) -> dict[str, Any]:
        nodes = sorted(g.get_node_ids())
        aggregator = SecAggPlusAggregator(SecAggConfig(num_shares=1.0, stage_timeout_s=60))
        content = RecordDict({keys.REC_CONFIG: ConfigRecord(DDP)})
        return {"r": aggregator.aggregate(g, 1, nodes, content, SPEC, 60)}

    DATA["seed"] = 11
    result = drive(grid, script)["r"]
    assert set(result.summed_metrics) == {keys.MET_LOCAL_STEPS, MET_DP_TRAIN_LOSS}
    clear = sum(min(12.0, float(np.mean(private_data(pid) ** 2))) for pid in range(3))
    assert result.summed_metrics[MET_DP_TRAIN_LOSS] != pytest.approx(clear, abs=1e-3)
    z = 0.2 * math.sqrt(1 + 2 * 2 - 2) / 0.1  # n = 2 neighbours, t = 2: 3 verified
    for ledger in ledgers(tmp_path / "node-state"):
        assert ledger["user-level"] == pytest.approx([z, 3 * z])


def test_no_metric_leaves_in_clear_under_any_policy_seeded(
    make_grid: Callable[..., InProcessGrid],
) -> None:
    """Seeded random deviations: 24 trials, each a random policy (require-secagg, require-dp,
    max-epsilon, mixes) and a random request (plain, DP-SGD, distributed DP, each with or
    without SecAgg+, with random DP numbers), with fresh private data. On main a plain or
    DP-SGD reply under require-dp carried the clear loss, the example count and the user's
    metric. Every reply that is not refused now carries in clear only :data:`PUBLIC_METRICS`
    (a SecAgg+ sum without DP: any metric, summed) and none of the node's data-dependent
    values; the data shows without a policy."""
    rng = np.random.default_rng(30)
    policies = [
        "require-secagg = true\n",
        "require-dp = true\nmin-noise = 0.1\n",
        "require-secagg = true\nrequire-dp = true\nmin-noise = 0.1\n",
        "max-epsilon = 50.0\nmin-noise = 0.1\n",
    ]
    checked = 0
    for trial in range(24):
        policy = policies[int(rng.integers(len(policies)))]
        kind = ["plain", "dp-sgd", "ddp"][int(rng.integers(3))]
        secagg = bool(rng.integers(2))
        config: dict[str, Any] = {"weighting": "uniform"}
        if kind == "dp-sgd":
            config["dp-sgd-noise-multiplier"] = float(rng.uniform(0.2, 2.0))
        elif kind == "ddp":
            config.update(DDP, **{"dp-noise-std": float(rng.uniform(0.05, 0.5))})
        DATA["seed"] = 5000 + trial
        seen = _one_round(make_grid(policy, 3), config, secagg)
        private = {
            v
            for pid in range(3)
            for v in (
                float(np.mean(private_data(pid) ** 2)),
                float(len(private_data(pid))),
                float(np.abs(private_data(pid)).max()) / 10,
            )
        }
        for metrics in seen:  # a SecAgg+ sum without DP may hold any summed metric
            if kind != "plain" or not secagg:
                assert set(metrics) <= PUBLIC_METRICS, (trial, policy, kind, metrics)
            assert not any(float(v) in private for v in metrics.values()), (trial, metrics)
            checked += 1
    assert checked > 0  # some replies were answered (not every one refused)
    plain = _one_round(make_grid(None, 3), {"weighting": "uniform"}, False)
    assert any(keys.MET_TRAIN_LOSS in m for m in plain)  # without a policy the data shows


def _one_round(grid: InProcessGrid, config: dict[str, Any], secagg: bool) -> list[dict[str, Any]]:
    """The clear metrics of every non-refused reply of one round (plain or SecAgg+)."""

    def script(g: Grid) -> dict[str, Any]:
        nodes = sorted(g.get_node_ids())
        content = RecordDict({keys.REC_CONFIG: ConfigRecord(config)})
        if secagg:
            aggregator = SecAggPlusAggregator(SecAggConfig(num_shares=1.0, stage_timeout_s=60))
            result = aggregator.aggregate(g, 1, nodes, content, SPEC, 60)
            return {"m": [result.summed_metrics] if result.summed_metrics else []}
        msgs = [
            Message(
                RecordDict({keys.REC_CONFIG: ConfigRecord(config)}),
                dst_node_id=n,
                message_type=MessageType.TRAIN,
            )
            for n in nodes
        ]
        replies = list(g.send_and_receive(msgs, timeout=60))
        return {
            "m": [
                dict(r.content.metric_records[keys.REC_METRICS])
                for r in replies
                if not r.has_error() and keys.REC_METRICS in r.content.metric_records
            ]
        }

    return drive(grid, script)["m"]
