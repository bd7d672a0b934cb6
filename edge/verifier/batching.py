"""One target forward pass over several sessions of different lengths: padding, masks, positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from fedge.edge import _hf


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one position of a model's KV cache."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: PreTrainedModel) -> KVGeometry:
        """Read layers, KV heads and head size from a Llama-like config."""
        cfg = model.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        return cls(int(cfg.num_hidden_layers), heads, head_dim, next(model.parameters()).dtype)

    @property
    def bytes_per_position(self) -> int:
        """KV bytes one token adds to a session."""
        return 2 * self.layers * self.heads * self.head_dim * self.dtype.itemsize


def batched_forward(
    model: PreTrainedModel,
    geometry: KVGeometry,
    caches: Sequence[DynamicCache],
    inputs: list[list[int]],
) -> tuple[torch.Tensor, _hf.KV]:
    """Run every session's new tokens on its own past in one pass, padded to a rectangle.

    The sessions' caches (L_b positions each) are copied, left-padded to the longest past P,
    into one batch, and the inputs right-padded to the longest T, so every session's new
    tokens start at column P; the attention mask hides the padding and position ids continue
    each session's own length. The caches themselves are not changed. Returns logits
    [B, T, V] and, per layer, the new positions' keys and values [B, heads, T, head_dim]
    (views into the pass's output).
    """
    lengths = [_hf.cache_length(cache) for cache in caches]
    counts = [len(tokens) for tokens in inputs]
    size, longest_past, longest_new = len(inputs), max(lengths), max(counts)
    input_ids = torch.tensor([tokens + [0] * (longest_new - len(tokens)) for tokens in inputs])
    past_len = torch.tensor(lengths)[:, None]  # [B, 1]
    positions = past_len + torch.arange(longest_new)[None, :]  # [B, T]: each session's own
    column = torch.arange(longest_past + longest_new)[None, :]  # [1, P + T]
    real_past = column >= longest_past - past_len  # left padding of the past is hidden
    real_new = column < longest_past + torch.tensor(counts)[:, None]  # right padding too
    mask = (real_past & real_new).long()
    shape = (size, geometry.heads, longest_past, geometry.head_dim)
    padded: _hf.KV = []
    pasts = [_hf.cache_to_kv(cache) for cache in caches]
    for layer in range(geometry.layers):  # one copy of each session's past, straight from its cache
        keys = torch.zeros(shape, dtype=geometry.dtype)
        values = torch.zeros(shape, dtype=geometry.dtype)
        for b, past in enumerate(pasts):
            if lengths[b]:
                keys[b, :, longest_past - lengths[b] :] = past[layer][0][0]
                values[b, :, longest_past - lengths[b] :] = past[layer][1][0]
        padded.append((keys, values))
    logits, out = _hf.forward(model, input_ids, padded, mask, positions)
    # each output layer is [B, heads, P + T, head_dim]; column P holds each session's first new token
    return logits, [(k[:, :, longest_past:], v[:, :, longest_past:]) for k, v in out]
