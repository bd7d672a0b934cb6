"""The runtimes the engine's worker runs its model through: one interface, several targets.

The worker never calls the model itself: it asks its `Runtime` to prefill a prompt into a
cache, to run new tokens on one cache in place, or (for caches the runtime can batch) to run
several caches in one padded pass. `TorchRuntime` is the in-process transformers model;
`ShardedRuntime` sends prompts above a threshold to a ring of worker processes
(`fedge.edge.verifier.ring`) and keeps everything else on the runtime it wraps;
`OrtRuntime` (`fedge.edge.verifier.ort`) runs an ONNX export of the same weights.
`build_runtime` picks one as configured: `auto` times a short prefill and decode on torch
and on ONNX Runtime and keeps the faster, as the edge orders its draft runtimes by
measured decode time.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from fedge.edge import _hf
from fedge.edge.verifier.batching import KVGeometry, batched_forward
from fedge.edge.verifier.ring import RingConfig, RingPool, ShardedKV

LOG = logging.getLogger("fedge.verifier")
RUNTIMES = ("auto", "torch", "onnx")  # EngineConfig.runtime's choices
PROBE_PROMPT = 32  # tokens prefilled by `auto`'s timing probe
PROBE_STEPS = 8  # single-token decode steps it times (their median decides)

__all__ = ["RUNTIMES", "Runtime", "ShardedRuntime", "TorchRuntime", "build_runtime"]


class Runtime(Protocol):
    """What the engine's worker needs from a model target."""

    geometry: KVGeometry  # of the KV it holds in this process (local_bytes counts in it)

    def start(self) -> None:
        """Get ready to serve (spawn processes, load sessions); called by the engine's start."""

    def stop(self) -> None:
        """Release what `start` took."""

    def prefill(self, tokens: Sequence[int], want_logits: bool = False) -> tuple[Any, Any]:
        """A new cache holding `tokens`' KV, and (when asked) the last position's logits [1, 1, V]."""

    def forward_on(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run input_ids [1, T] after `cache`, growing it in place; logits [1, T, V]."""

    def batchable(self, cache: Any) -> bool:
        """True if `cache` may join a padded batch (`batched_forward`)."""

    def batched_forward(
        self, caches: Sequence[Any], inputs: list[list[int]]
    ) -> tuple[torch.Tensor, _hf.KV]:
        """Several batchable caches in one pass: logits [B, T, V] and the new positions' KV."""

    def local_bytes(self, tokens: int) -> int:
        """Engine-held KV bytes a prefill of `tokens` tokens adds (0 when held elsewhere)."""

    def release(self, cache: Any) -> None:
        """Free a cache held outside this process (its session left the store)."""

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call `callback()` when caches held elsewhere are lost (their sessions must go)."""


class LocalKVRuntime:
    """What runtimes holding each session's KV in this process share: its bytes follow from
    the model's geometry, nothing to release beyond the cache object, never lost."""

    geometry: KVGeometry

    def local_bytes(self, tokens: int) -> int:
        return tokens * self.geometry.bytes_per_position

    def release(self, cache: Any) -> None:
        return None

    def on_lost(self, callback: Callable[[], None]) -> None:
        return None


class TorchRuntime(LocalKVRuntime):
    """The model in this process: DynamicCache sessions, padded batches."""

    def __init__(self, model: PreTrainedModel, geometry: KVGeometry) -> None:
        self.model = model
        self.geometry = geometry

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def prefill(
        self, tokens: Sequence[int], want_logits: bool = False
    ) -> tuple[DynamicCache, torch.Tensor | None]:
        cache = DynamicCache()
        logits = None
        if tokens:
            logits = _hf.forward_on(self.model, torch.tensor([list(tokens)]), cache)
        return cache, (logits[:, -1:] if want_logits and logits is not None else None)

    def forward_on(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        return _hf.forward_on(self.model, input_ids, cache)

    def batchable(self, cache: Any) -> bool:
        return True

    def batched_forward(
        self, caches: Sequence[Any], inputs: list[list[int]]
    ) -> tuple[torch.Tensor, _hf.KV]:
        return batched_forward(self.model, self.geometry, caches, inputs)


class ShardedRuntime:
    """Prompts of more than `config.threshold` tokens go to a ring; all else to `local`.

    A sharded session's verify and decode steps run on the ring too (each rank attends the
    new tokens to its own KV block; see `fedge.lm.ring`); it never joins a padded batch.
    """

    def __init__(self, local: TorchRuntime, config: RingConfig) -> None:
        self.local = local
        self.geometry = local.geometry
        self.config = config
        self.pool = RingPool(local.model, config, local.geometry.bytes_per_position)

    def start(self) -> None:
        self.pool.start()

    def stop(self) -> None:
        self.pool.stop()

    def sharded(self, tokens: int) -> bool:
        """True when a prefill of `tokens` tokens goes to the ring."""
        return tokens > self.config.threshold

    def prefill(self, tokens: Sequence[int], want_logits: bool = False) -> tuple[Any, Any]:
        if not self.sharded(len(tokens)):
            return self.local.prefill(tokens, want_logits)
        if not want_logits:
            kv, _ = self.pool.prefill(tokens)
            return kv, None
        kv, _ = self.pool.prefill(tokens[:-1])  # the last token's pass gives the logits
        try:
            return kv, self.pool.step(kv, tokens[-1:])[:, -1:]
        except Exception:
            self.pool.release(kv)
            raise

    def forward_on(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        if isinstance(cache, ShardedKV):
            return self.pool.step(cache, input_ids[0].tolist())
        return self.local.forward_on(input_ids, cache)

    def batchable(self, cache: Any) -> bool:
        return not isinstance(cache, ShardedKV)

    def batched_forward(
        self, caches: Sequence[Any], inputs: list[list[int]]
    ) -> tuple[torch.Tensor, _hf.KV]:
        return self.local.batched_forward(caches, inputs)

    def local_bytes(self, tokens: int) -> int:
        return 0 if self.sharded(tokens) else self.local.local_bytes(tokens)

    def release(self, cache: Any) -> None:
        if isinstance(cache, ShardedKV):
            self.pool.release(cache)

    def on_lost(self, callback: Callable[[], None]) -> None:
        self.pool.on_failure(callback)


def build_runtime(
    model: PreTrainedModel,
    geometry: KVGeometry,
    choice: str,
    ring: RingConfig | None = None,
    threads: int = 0,
) -> Runtime:
    """The runtime `choice` names ("torch", "onnx" or "auto"), wrapped in a ring when one is set.

    A ring's workers run torch, so a ring serves torch (an "onnx" choice with a ring is refused
    by `EngineConfig`). "auto" exports the model (cached by its weights' digest), checks it
    against torch, times both (`PROBE_PROMPT` tokens prefilled, median of `PROBE_STEPS` decode
    steps) and keeps the faster; without onnxruntime, or on an export that fails, it serves torch.
    """
    if choice not in RUNTIMES:
        raise ValueError(f"unknown verifier runtime {choice!r}; choose one of {list(RUNTIMES)}")
    local = TorchRuntime(model, geometry)
    if ring is not None:
        if choice == "onnx":
            raise ValueError("runtime 'onnx' cannot serve a ring: ring workers run torch")
        return ShardedRuntime(local, ring)
    if choice == "torch":
        return local
    if choice == "onnx":
        return _onnx_runtime(model, threads)
    try:
        onnx = _onnx_runtime(model, threads)
    except Exception as exc:  # auto falls back, saying why
        LOG.warning("verifier runtime auto: ONNX Runtime unavailable (%s); serving torch", exc)
        return local
    vocab = int(model.get_output_embeddings().weight.shape[0])
    timed = {name: probe_decode(rt, vocab) for name, rt in (("torch", local), ("onnx", onnx))}
    chosen = min(timed, key=lambda name: timed[name][1])
    LOG.info(
        "verifier runtime auto: %s (prefill of %d tokens / decode step: %s)",
        chosen,
        PROBE_PROMPT,
        ", ".join(f"{n} {p * 1e3:.1f} / {d * 1e3:.2f} ms" for n, (p, d) in timed.items()),
    )
    return onnx if chosen == "onnx" else local


def _onnx_runtime(model: PreTrainedModel, threads: int) -> Runtime:
    """The ONNX runtime over `model`'s cached export, checked against the torch model."""
    from fedge.edge.verifier.ort import OrtRuntime, check_against, target_export

    runtime = OrtRuntime(target_export(model), threads or torch.get_num_threads())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    error = check_against(runtime, model, vocab)
    LOG.info("verifier ONNX target %s (relative logit error %.2g)", runtime.export, error)
    return runtime


def probe_decode(runtime: Runtime, vocab: int) -> tuple[float, float]:
    """Seconds of a `PROBE_PROMPT`-token prefill and the median of `PROBE_STEPS` decode steps."""
    prompt = [(5 * i + 1) % vocab for i in range(PROBE_PROMPT)]
    with torch.inference_mode():
        runtime.prefill(prompt[:4])  # first-call warm-up (allocations, kernel choice)
        started = time.perf_counter()
        cache, _ = runtime.prefill(prompt)
        prefill = time.perf_counter() - started
        steps = []
        for i in range(PROBE_STEPS):
            started = time.perf_counter()
            runtime.forward_on(torch.tensor([[prompt[i]]]), cache)
            steps.append(time.perf_counter() - started)
        runtime.release(cache)
    return prefill, statistics.median(steps)
