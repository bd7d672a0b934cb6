"""One target forward pass over several sessions of different lengths: padding, masks, positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from edge import _hf


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

    def empty(self) -> _hf.KV:
        """Zero-length KV tensors for a session whose cache is still empty."""
        empty = torch.zeros(1, self.heads, 0, self.head_dim, dtype=self.dtype)
        return [(empty, empty) for _ in range(self.layers)]


@torch.no_grad()
def batched_forward(
    model: PreTrainedModel, geometry: KVGeometry, pasts: list[_hf.KV], inputs: list[list[int]]
) -> tuple[torch.Tensor, _hf.KV]:
    """Run every session's new tokens on its own past in one pass, padded to a rectangle.

    KV caches are left-padded to the longest past P, inputs right-padded to the
    longest T, so every session's new tokens start at column P; the attention mask
    hides the padding and position ids continue each session's own length. Returns
    logits [B, T, V] and the new tokens' KV, per layer [B, heads, T, head_dim].
    """
    lengths = [_hf.kv_length(past) for past in pasts]
    size, longest_past, longest_new = len(inputs), max(lengths), max(len(x) for x in inputs)
    input_ids = torch.zeros(size, longest_new, dtype=torch.long)
    positions = torch.zeros(size, longest_new, dtype=torch.long)
    mask = torch.zeros(size, longest_past + longest_new, dtype=torch.long)
    kv: _hf.KV = []
    for layer in range(geometry.layers):
        shape = (size, geometry.heads, longest_past, geometry.head_dim)
        keys = torch.zeros(shape, dtype=geometry.dtype)
        values = torch.zeros_like(keys)
        for b, past in enumerate(pasts):
            key, value = past[layer]
            keys[b, :, longest_past - lengths[b] :] = key[0]
            values[b, :, longest_past - lengths[b] :] = value[0]
        kv.append((keys, values))
    for b, tokens in enumerate(inputs):
        input_ids[b, : len(tokens)] = torch.tensor(tokens)
        positions[b] = lengths[b] + torch.arange(longest_new)
        mask[b, longest_past - lengths[b] : longest_past + len(tokens)] = 1
    logits, new_kv = _hf.forward(model, input_ids, kv, mask, positions)
    # new_kv[layer] is [B, heads, P + T, head_dim]; column P holds each session's first new token
    return logits, [(k[:, :, longest_past:], v[:, :, longest_past:]) for k, v in new_kv]
