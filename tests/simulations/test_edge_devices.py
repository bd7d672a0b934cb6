"""Emulated devices: a replayed draft decodes exactly as the real one; the capacity search."""

from __future__ import annotations

import pytest
import torch

from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig, VerifierEngine
from fedge.simulations.edge_devices import (
    ReplayRuntime,
    ReplayTable,
    RequestFigures,
    devices_meeting,
    max_devices,
)
from fedge.zoo import ZooPaths

NEW = 20


def test_replayed_draft_decodes_like_the_real_draft(micro_zoo: ZooPaths) -> None:
    """Same tokens, same rounds, same accepted counts at every draft length: the verifier sees
    the same work from a replaying device as from a real one."""
    from fedge.models import load_causal_lm

    target, draft = load_causal_lm(micro_zoo.target_dir), load_causal_lm(micro_zoo.draft_dir)
    prompt = list(range(5, 17))
    ids = torch.tensor([prompt])
    greedy = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW + 1)
    table = ReplayTable.record(
        TorchDraftRuntime(draft), prompt, greedy[0, len(prompt) :].tolist(), 8
    )
    sleeps: list[float] = []
    engine = VerifierEngine(target, EngineConfig(max_draft=8, max_context=128)).start()
    try:
        for k in (1, 3, 8):
            config = DecodeConfig(max_new_tokens=NEW, draft_len=k, max_draft=8, adaptive=False)
            real = SpeculativeDecoder(TorchDraftRuntime(draft), engine, config)
            replay = SpeculativeDecoder(ReplayRuntime(table, 0.002, sleeps.append), engine, config)
            assert replay.generate(prompt) == real.generate(prompt)
            assert (replay.stats.rounds, replay.stats.accepted) == (
                real.stats.rounds,
                real.stats.accepted,
            )
    finally:
        engine.stop()
    assert sleeps and set(sleeps) == {0.002}  # one draft step waited per draft call


def test_replay_refuses_another_prompt(micro_zoo: ZooPaths) -> None:
    table = ReplayTable(3, (1, 2, 3, 4), ((9,), (8,)), 16, 32)
    assert table.next_token([1, 2, 3]) == 9
    assert table.next_token([1, 2, 3, 4]) == 8
    with pytest.raises(ValueError, match="recorded prompt"):
        table.next_token([7, 2, 3])


@pytest.mark.parametrize(
    ("capacity", "refine", "expected"), [(11, 2, 10), (11, 5, 11), (200, 2, 128), (0, 2, 0)]
)
def test_max_devices_doubles_then_bisects(capacity: int, refine: int, expected: int) -> None:
    """Capacity 11: 1, 2, 4, 8 pass, 16 fails; bisection tries 12 (fails), then 10 (passes):
    10 after two steps, 11 after a third (11). Never past the limit; 0 when one device fails."""
    best, seen = max_devices(lambda n: n <= capacity, limit=128, refine=refine)
    assert best == expected
    assert max(seen) <= 128


def test_devices_meeting_counts_whole_devices() -> None:
    """Device 0: 40 tokens in 2 s (20/s) meets 15/s; device 1: 40 in 4 s (10/s) does not;
    device 2 is fast but one request started after 1.5 s; device 3 failed once."""
    figures = [
        RequestFigures(0, "speculative", "", 20, 1.0, 0.2, 5),
        RequestFigures(0, "speculative", "", 20, 1.0, 0.3, 5),
        RequestFigures(1, "cloud-only", "", 40, 4.0, 0.1, 1),
        RequestFigures(2, "cloud-only", "", 40, 1.0, 1.5, 1),
        RequestFigures(3, "cloud-only", "", 40, 1.0, 0.1, 1),
        RequestFigures(3, "cloud-only", "failed", 0, 0.1, 0.1, 0, "UNAVAILABLE"),
    ]
    assert devices_meeting(figures, 15.0, 1.0) == (1, 4)
