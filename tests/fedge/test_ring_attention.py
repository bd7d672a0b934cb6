"""fedge.lm.ring without processes: the zig-zag layout, blockwise online softmax, the patched model.

Expectations are the textbook ones: softmax(q k^T * scale + causal mask) v with key heads
shared by groups of query heads, and the model's own SDPA forward.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from fedge.lm.ring import (
    RingShard,
    ZigzagLayout,
    attend_block,
    enable_ring_attention,
    merge_into,
    ring_session,
)
from tests.architectures import random_gqa


@pytest.mark.parametrize(("length", "world"), [(256, 2), (4096, 4), (37, 4), (8, 4)])
def test_zigzag_layout_covers_every_position_once_and_balances_causal_work(
    length: int, world: int
) -> None:
    positions = [ZigzagLayout(length, world).positions(r) for r in range(world)]
    assert sorted(torch.cat(positions).tolist()) == list(range(length))
    # causal work of a rank = sum over its queries of (position + 1) keys: chunk r and chunk
    # 2N-1-r of c tokens give c * ((2N-1)c + c + 1) whatever r, so equal when c divides evenly
    work = [int((p + 1).sum()) for p in positions]
    if length % (2 * world) == 0:
        assert len(set(work)) == 1
    else:
        assert max(work) / min(work) < 1.3
    contiguous = [
        sum(range(r * length // world + 1, (r + 1) * length // world + 1)) for r in range(world)
    ]
    assert max(contiguous) / min(contiguous) > 2  # what the zig-zag avoids


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    t = q.shape[2]
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def test_blockwise_online_softmax_with_gqa_equals_full_causal_attention() -> None:
    """Keys in blocks of 7, merged by log-sum-exp, with 6 query heads over 2 key heads."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 8, generator=g) for h in (6, 2, 2))
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:-1], -math.inf)
    for start in range(0, 40, 7):
        end = min(start + 7, 40)
        part, part_lse = attend_block(
            q, k[:, :, start:end], v[:, :, start:end], 0.3, (0, 40), (start, end)
        )
        merge_into(out, lse, part, part_lse)
    assert torch.allclose(out, _reference(q, k, v, 0.3), atol=1e-6)


def test_a_query_that_sees_no_key_yet_stays_zero_until_one_arrives() -> None:
    q, k, v = torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), torch.full((1, 1, 1, 4), 2.0)
    out, lse = attend_block(q, k, v, 1.0, (3, 4), (5, 6))  # the key comes after the query
    assert out.abs().sum() == 0 and torch.isinf(lse).all()
    acc, acc_lse = torch.zeros(1, 1, 1, 4), torch.full((1, 1, 1), -math.inf)
    merge_into(acc, acc_lse, out, lse)
    assert not torch.isnan(acc).any()
    seen, seen_lse = attend_block(q, k, v, 1.0, (3, 4), (0, 1))
    merge_into(acc, acc_lse, seen, seen_lse)
    assert torch.allclose(acc, torch.full((1, 1, 1, 4), 2.0))


def test_patched_llama_through_a_ring_of_one_equals_its_own_forward() -> None:
    """The attention-interface patch on a GQA Llama, prefill then a decode step, world of 1."""
    model = random_gqa("llama", 0, heads=4, kv_heads=2, vocab_size=128, hidden_size=64)
    tokens = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            enable_ring_attention(model)
            shard = RingShard(ZigzagLayout(47, 1), 0, block=16)
            with torch.no_grad(), ring_session(shard):
                prefill = model(
                    input_ids=tokens[:, :47], position_ids=shard.layout.positions(0)[None]
                )
                shard.mode = "decode"
                step = model(input_ids=tokens[:, 47:], position_ids=torch.arange(47, 50)[None])
        finally:
            dist.destroy_process_group()
    assert (prefill.logits - expected[:, :47]).abs().max() < 1e-5
    assert (step.logits - expected[:, 47:]).abs().max() < 1e-5
    assert shard.length == 50
