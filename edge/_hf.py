"""Thin bridge to transformers' KV cache: explicit (key, value) tensors in, logits and tensors out.

transformers renamed `past_key_values` to `cache` (5.x) and moved cache tensors
from `key_cache`/`value_cache` lists to `layers[i].keys/values`; everything in
`edge` goes through these helpers so only this file knows.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

KV = list[
    tuple[torch.Tensor, torch.Tensor]
]  # per layer: key, value each [B, kv_heads, L, head_dim]


@functools.cache
def _cache_kwarg(model_cls: Any) -> str:
    """Name of the forward() argument that takes the KV cache for this model class."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv_to_cache(kv: KV) -> DynamicCache:
    """Wrap explicit per-layer (key, value) tensors in a DynamicCache."""
    cache = DynamicCache()
    for layer, (key, value) in enumerate(kv):
        cache.update(key, value, layer)
    return cache


def cache_to_kv(cache: object) -> KV:
    """Read per-layer (key, value) tensors out of a transformers cache object."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # type: ignore[attr-defined]


def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    kv: KV | None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KV]:
    """One forward pass continuing `kv`; returns logits [B, T, V] and the extended KV."""
    cache = kv_to_cache(kv) if kv else DynamicCache()
    logits = forward_on(model, input_ids, cache, attention_mask, position_ids)
    return logits, cache_to_kv(cache)


def forward_on(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward pass that appends the new tokens' KV to `cache` in place; returns logits [B, T, V].

    This is how `generate` decodes: no copy of the past per call (DynamicCache grows by
    concatenation, as in transformers' own greedy loop).
    """
    model_cls: Any = type(model)
    kwargs = {_cache_kwarg(model_cls): cache}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **kwargs,
    )
    grown = out["cache"] if "cache" in out else out["past_key_values"]
    if grown is not cache:  # every cache class this code meets updates in place
        raise RuntimeError(
            f"{model_cls.__name__} returned a new cache object instead of growing it"
        )
    logits: torch.Tensor = out.logits
    return logits


def cache_length(cache: DynamicCache) -> int:
    """Sequence positions held by a cache object (0 when empty)."""
    return int(cache.get_seq_length())


def cache_nbytes(cache: DynamicCache) -> int:
    """Memory held by a cache object's key and value tensors, in bytes.

    A cache object that knows what it keeps alive says so by an `nbytes` attribute.
    """
    held = getattr(cache, "nbytes", None)
    if held is not None:
        return int(held)
    return sum(
        key.numel() * key.element_size() + value.numel() * value.element_size()
        for key, value in cache_to_kv(cache)
        if key is not None
    )


def drop_last(cache: DynamicCache, positions: int) -> None:
    """Forget the last `positions` positions of a cache (rejected draft tokens)."""
    if positions > 0:
        cache.crop(-positions)


def append_kv(cache: DynamicCache, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append per-layer keys and values [1, heads, T, head_dim] to a cache."""
    for layer, (key, value) in enumerate(kv):
        cache.update(key, value, layer)


def kv_length(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Sequence positions held by a KV cache (0 when empty)."""
    return int(kv[0][0].shape[2]) if kv else 0
