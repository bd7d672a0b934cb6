"""Ring attention (Liu et al., 2023, arXiv:2310.01889): exact causal attention over a sequence
split across a ring of processes, none of which holds the whole sequence's keys, values or scores.

The sequence is cut into 2N chunks and rank r keeps chunks r and 2N-1-r (the zig-zag layout:
every rank then holds one early and one late chunk, so under the causal mask each does about the
same work). Each rank computes its tokens' queries, keys and values with the untouched model (RoPE
applied at its tokens' global positions, passed as `position_ids`); inside every attention layer
the key/value blocks travel around the ring: while a rank attends its queries to the block in
hand it already sends that block on and receives the next one (`isend`/`irecv`, gloo on CPU, NCCL
on GPUs). Partial results combine exactly by an online softmax: each block gives a normalised
output and the log-sum-exp of its scores, and two partials merge by weights exp(lse_i - lse).

After the prefill each rank keeps its own KV block. A decode step (new tokens, the same on every
rank) attends to each rank's block locally, the partials (output and log-sum-exp, a few KiB) are
all-gathered and merged in rank order, then merged with the new tokens' attention to themselves;
one rank (the step's `owner`) appends the new keys and values. Nothing gathers the whole cache.

Models take part through transformers' attention registry (`AttentionInterface`): the function
registered as `RING_ATTENTION` replaces only the score/softmax/value product of each attention
layer of a Llama-family model (Llama, Qwen2, Mistral without a sliding window); projections, RoPE,
norms and MLPs stay the model's own. Keys and values may have fewer heads than queries (GQA).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

RING_ATTENTION = "fedge_ring"  # the name registered in transformers' AttentionInterface

__all__ = [
    "RING_ATTENTION",
    "RingShard",
    "RingStats",
    "ZigzagLayout",
    "attend_block",
    "enable_ring_attention",
    "merge_into",
    "ring_session",
]


@dataclass(frozen=True)
class ZigzagLayout:
    """Which global positions each of `world` ranks holds of a `length`-token sequence.

    Chunk c of 2*world covers [c*length // (2*world), (c+1)*length // (2*world)); rank r
    holds chunks r and 2*world-1-r, in that order, so its local tensors are those two ranges
    concatenated.
    """

    length: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.length < 1:
            raise ValueError(f"ZigzagLayout needs length >= 1 and world >= 1, got {self}")

    def _bound(self, chunk: int) -> int:
        return chunk * self.length // (2 * self.world)

    def ranges(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two [start, end) position ranges rank `rank` holds (either may be empty)."""
        late = 2 * self.world - 1 - rank
        return (
            (self._bound(rank), self._bound(rank + 1)),
            (self._bound(late), self._bound(late + 1)),
        )

    def size(self, rank: int) -> int:
        """Tokens rank `rank` holds."""
        return sum(end - start for start, end in self.ranges(rank))

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions of rank `rank`'s tokens, in local order (int64 [size])."""
        return torch.cat([torch.arange(s, e) for s, e in self.ranges(rank)])


@dataclass
class RingStats:
    """Time a rank spent in the last ring forward: computing, and waiting on the ring."""

    compute_s: float = 0.0  # attention on blocks in hand (transfers in flight meanwhile)
    wait_s: float = 0.0  # blocked on a transfer after the block in hand was done
    bytes_sent: int = 0
    steps: int = 0

    def reset(self) -> None:
        self.compute_s = self.wait_s = 0.0
        self.bytes_sent = self.steps = 0


def attend_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    q_range: tuple[int, int] | None = None,
    k_range: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, Hq, Tq, D] on k, v [B, Hkv, Tk, D]: (output, log-sum-exp).

    Returns the normalised output [B, Hq, Tq, D] and the log-sum-exp of the scaled scores
    [B, Hq, Tq]; a query that may see no key gets output 0 and lse -inf. With ranges given
    (contiguous global positions of the queries and of the keys) key j is hidden from query
    i when pos(j) > pos(i). Query heads are grouped over the key heads (GQA) by a view, so
    keys and values are never repeated in memory.
    """
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, tq, d)  # query heads of one KV head side by side
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scaling  # [B, Hkv, G, Tq, Tk]
    if q_range is not None and k_range is not None and k_range[1] - 1 > q_range[0]:
        q_pos = torch.arange(q_range[0], q_range[1], device=q.device)[:, None]
        k_pos = torch.arange(k_range[0], k_range[1], device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G, Tq]
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    scores.sub_(finite.unsqueeze(-1)).exp_()  # probabilities in place; fully masked rows are 0
    out = torch.matmul(scores, v.unsqueeze(2))  # [B, Hkv, G, Tq, D]
    return out.reshape(b, hq, tq, d), lse.reshape(b, hq, tq)


def merge_into(
    acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Fold a partial (out, lse) into the running (acc_out, acc_lse), in place (online softmax).

    new_lse = log(exp(acc_lse) + exp(lse)); acc_out = acc_out * exp(acc_lse - new_lse) +
    out * exp(lse - new_lse). Rows where both are -inf (no key seen yet) stay 0 / -inf.
    """
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    acc_out.mul_(torch.exp(acc_lse - safe).unsqueeze(-1))
    acc_out.add_(out * torch.exp(lse - safe).unsqueeze(-1))
    acc_lse.copy_(new)


def _split(start: int, end: int, block: int) -> Iterator[tuple[int, int]]:
    """[start, end) in pieces of at most `block` positions."""
    for s in range(start, end, block):
        yield s, min(s + block, end)


@dataclass
class RingShard:
    """One rank's part of one sequence: its layout, its KV block per layer, and its ring.

    `mode` is "prefill" while the prompt goes through (keys and values travel the ring) and
    "decode" afterwards (new tokens attend locally, partials are all-gathered).
    """

    layout: ZigzagLayout
    rank: int
    block: int = 256  # query and key positions per score block: scores are Hq x block x block
    group: Any = None  # torch.distributed process group; None = the default one
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    mode: str = "prefill"
    owner: int = 0  # decode: the rank that keeps this step's new keys and values
    overlap: bool = True  # False: wait for each transfer before computing (the bench's baseline)
    stats: RingStats = field(default_factory=RingStats)

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def length(self) -> int:
        """Positions this rank holds (its prefill block plus decode positions it owns)."""
        return int(self.kv[0][0].shape[2]) if self.kv else 0

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    def crop(self, positions: int) -> None:
        """Forget this rank's last `positions` decode positions (a rejected draft)."""
        if positions > 0:
            self.kv = [(k[:, :, :-positions], v[:, :, :-positions]) for k, v in self.kv]

    # ------------------------------------------------------------------ attention
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Attention output [B, Hq, T, D] of this rank's queries (already rotated)."""
        if self.mode == "prefill":
            if layer != len(self.kv):
                raise RuntimeError(f"ring prefill met layer {layer} after {len(self.kv)} layers")
            self.kv.append((k, v))
            return self._ring(q, k, v, scaling)
        return self._decode(layer, q, k, v, scaling)

    def _ring(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Prefill: pass KV blocks around the ring, overlapping each transfer with compute."""
        world, rank, layout = self.world, self.rank, self.layout
        acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        block = torch.stack([k, v]).contiguous()  # [2, B, Hkv, T, D]: one message per step
        owner = rank
        for step in range(world):
            pending: list[Any] = []
            incoming = None
            if step < world - 1:  # start the next transfer before computing on this block
                source = (rank - step - 1) % world
                shape = (*block.shape[:3], layout.size(source), block.shape[4])
                incoming = torch.empty(shape, dtype=block.dtype, device=block.device)
                pending = [
                    dist.isend(block, (rank + 1) % world, group=self.group),
                    dist.irecv(incoming, (rank - 1) % world, group=self.group),
                ]
                self.stats.bytes_sent += block.numel() * block.element_size()
            if not self.overlap:  # transfer first, then compute: nothing hidden
                waiting = time.perf_counter()
                for request in pending:
                    request.wait()
                self.stats.wait_s += time.perf_counter() - waiting
                pending = []
            started = time.perf_counter()
            self._attend_ranges(q, block, layout.ranges(owner), scaling, acc_out, acc_lse)
            waited = time.perf_counter()
            for request in pending:
                request.wait()
            self.stats.compute_s += waited - started
            self.stats.wait_s += time.perf_counter() - waited
            self.stats.steps += 1
            if incoming is not None:
                block, owner = incoming, (rank - step - 1) % world
        return acc_out.to(q.dtype)

    def _attend_ranges(
        self,
        q: torch.Tensor,
        block: torch.Tensor,
        k_ranges: tuple[tuple[int, int], ...],
        scaling: float,
        acc_out: torch.Tensor,
        acc_lse: torch.Tensor,
    ) -> None:
        """Fold the block's keys into every query they may reach, `self.block` x `self.block` at a time.

        Queries and keys both go in pieces of `self.block` positions, so the score workspace
        is Hq x block x block whatever the length; a piece of keys wholly after a piece of
        queries is skipped (causal), one wholly before it needs no mask.
        """
        q_offset = 0
        for q_start, q_end in self.layout.ranges(self.rank):
            for qs, qe in _split(q_start, q_end, self.block):
                rows = slice(q_offset + qs - q_start, q_offset + qe - q_start)
                k_offset = 0
                for k_start, k_end in k_ranges:
                    for ks, ke in _split(k_start, k_end, self.block):
                        if ks > qe - 1:
                            break  # causal: these keys come after every query of the piece
                        cols = slice(k_offset + ks - k_start, k_offset + ke - k_start)
                        out, lse = attend_block(
                            q[:, :, rows], block[0, :, :, cols], block[1, :, :, cols], scaling,
                            (qs, qe), (ks, ke),
                        )  # fmt: skip
                        merge_into(acc_out[:, :, rows], acc_lse[:, :, rows], out, lse)
                    k_offset += k_end - k_start
            q_offset += q_end - q_start

    def _decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """New tokens (every rank the same): local partial, all-gather, merge, then the new part."""
        past_k, past_v = self.kv[layer]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        for s, e in _split(0, past_k.shape[2], self.block):  # every past position precedes q
            part, part_lse = attend_block(q, past_k[:, :, s:e], past_v[:, :, s:e], scaling)
            merge_into(out, lse, part, part_lse)
        mine = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()  # [B, Hq, T, D + 1]
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        started = time.perf_counter()
        dist.all_gather(gathered, mine, group=self.group)
        self.stats.wait_s += time.perf_counter() - started
        acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        for partial in gathered:  # rank order: every rank computes the same sums
            merge_into(acc_out, acc_lse, partial[..., :-1], partial[..., -1])
        t = q.shape[2]
        new_out, new_lse = attend_block(q, k, v, scaling, (0, t), (0, t))  # causal among new
        merge_into(acc_out, acc_lse, new_out, new_lse)
        if self.rank == self.owner:
            self.kv[layer] = (torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2))
        return acc_out.to(q.dtype)


_ACTIVE: RingShard | None = None


@contextlib.contextmanager
def ring_session(shard: RingShard) -> Iterator[RingShard]:
    """Route the ring attention function to `shard` for the forward passes inside the block."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, shard
    try:
        yield shard
    finally:
        _ACTIVE = previous


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: [B, H, T, D] in, [B, T, Hq, D] out.

    Outside `ring_session` it is plain SDPA (a model switched to ring attention still runs
    alone); inside, the active shard does the work and `attention_mask` is unused (the
    mask follows from the global positions).
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if _ACTIVE is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scale, **kwargs
        )
        return out, None
    layer = int(getattr(module, "layer_idx", 0))
    attn = _ACTIVE.attend(layer, query, key, value, scale)
    return attn.transpose(1, 2).contiguous(), None


def enable_ring_attention(model: torch.nn.Module) -> None:
    """Register ring attention with transformers and switch `model` to it.

    Refuses a model with a sliding attention window (Mistral's, Qwen2's when on): ring
    attention here is full causal attention.
    """
    from transformers import AttentionInterface

    config: Any = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        raise ValueError(
            f"ring attention serves full causal attention; this model has sliding_window="
            f"{window}: set it to None (or use_sliding_window=False) or serve it unsharded"
        )
    AttentionInterface.register(RING_ATTENTION, ring_attention_forward)
    # no mask: an implementation unknown to the mask registry gets attention_mask=None
    model.config._attn_implementation = RING_ATTENTION  # type: ignore[union-attr]
    for sub in model.modules():
        sub_config = getattr(sub, "config", None)
        if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
            sub_config._attn_implementation = RING_ATTENTION
