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

    def empty(self) -> torch.Tensor:
        """A zero-length stacked KV for a session whose cache is still empty."""
        return torch.zeros(1, 2 * self.layers, self.heads, 0, self.head_dim, dtype=self.dtype)


@torch.no_grad()
def batched_forward(
    model: PreTrainedModel, geometry: KVGeometry, pasts: list[torch.Tensor], inputs: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every session's new tokens on its own past in one pass, padded to a rectangle.

    `pasts` are stacked KV caches (edge._hf.stack_kv), [1, 2 * layers, heads, L_b, head_dim].
    They are left-padded to the longest past P and the inputs right-padded to the longest
    T, so every session's new tokens start at column P; the attention mask hides the
    padding and position ids continue each session's own length. Returns logits
    [B, T, V] and the new tokens' stacked KV [B, 2 * layers, heads, T, head_dim].
    """
    lengths = [int(past.shape[3]) for past in pasts]
    counts = [len(tokens) for tokens in inputs]
    size, longest_past, longest_new = len(inputs), max(lengths), max(counts)
    input_ids = torch.tensor([tokens + [0] * (longest_new - len(tokens)) for tokens in inputs])
    past_len = torch.tensor(lengths)[:, None]  # [B, 1]
    positions = (
        past_len + torch.arange(longest_new)[None, :]
    )  # [B, T]: each session's own positions
    column = torch.arange(longest_past + longest_new)[None, :]  # [1, P + T]
    real_past = column >= longest_past - past_len  # left padding of the past is hidden
    real_new = (
        column < longest_past + torch.tensor(counts)[:, None]
    )  # right padding of the input too
    mask = (real_past & real_new).long()
    padded = torch.zeros(
        size,
        2 * geometry.layers,
        geometry.heads,
        longest_past,
        geometry.head_dim,
        dtype=geometry.dtype,
    )
    for b, past in enumerate(pasts):  # one copy per session, all layers at once
        padded[b, :, :, longest_past - lengths[b] :] = past[0]
    logits, new_kv = _hf.forward(model, input_ids, _hf.unstack_kv(padded), mask, positions)
    # each new_kv layer is [B, heads, P + T, head_dim]; column P holds each session's first new token
    return logits, _hf.stack_kv(new_kv)[:, :, :, longest_past:]
