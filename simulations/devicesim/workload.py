"""What one client's local training costs a device: FLOPs per step, bytes moved, peak memory.

The model is the one the run trains (its shape read from the model directory) or, with
``timing-model``, a reference shape (e.g. Qwen2.5-0.5B) whose costs a device is timed
with while the run trains the small model this machine can afford (docs/phones.md).

Costs (per step of ``batch`` sequences of ``seq`` tokens, T = batch x seq):

* FLOPs: the frozen base needs forward and input-gradient matmuls, 4 x matmul params x T;
  the LoRA factors forward, input and weight gradients, 6 x LoRA params x T; attention
  scores and values 12 x layers x seq x hidden x T (forward 4, backward 8).
* Time on a FedScale device (ms per sample of a reference model, training 3x that): the
  device's rate on the reference, 3 x reference forward FLOPs per 3 x ms, applied to this
  workload's FLOPs, so a 0.5B LLM is not timed like a MobileNet.
* Memory: base weights at the device dtype; LoRA parameters, gradients and optimizer
  state in fp32 (AdamW: 2 states, SGD: none; ``optimizer = "auto"`` resolved to the
  strategy's own first); activations per layer s.b.h.(34 + 5.a.s/h)
  bytes (Korthikanti et al. 2022, 16-bit activations, no recomputation); fp32 logits and
  their gradient, 8.b.s.V bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from fedge.lm.targets import named_targets
from fedge.simulations.devicesim.population import (
    KIND_FLOPS,
    KIND_MS_PER_SAMPLE,
    KIND_SPEED,
    Population,
)

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
OPTIMIZER_STATES = {"adamw": 2.0, "sgd": 0.0}  # fp32 states per LoRA parameter
FEDSCALE_TRAIN_FACTOR = 3.0  # FedScale: backward ~ 2x forward, so training = 3x inference latency
# Forward FLOPs per sample of the model FedScale's ms/sample figures time. An assumption:
# MobileNetV2 at 224 x 224, 300M multiply-adds (Sandler et al. 2018) = 0.6 GFLOP; the
# [devices] key fedscale-reference-gflops overrides it (0: the figures time the run's model).
FEDSCALE_REFERENCE_FLOPS = 0.6e9


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the cost model needs (Hugging Face config names in the comments)."""

    params: int  # every base parameter (held on the device)
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_dim: int  # num_key_value_heads x head_dim
    intermediate: int  # intermediate_size
    vocab: int  # vocab_size
    tied: bool  # tie_word_embeddings
    model_type: str = "llama"  # config.model_type: picks the "auto" LoRA targets

    @property
    def matmul_params(self) -> int:
        """Parameters used in matmuls: all but the input embedding, unless the head shares it."""
        return self.params - (0 if self.tied else self.vocab * self.hidden)

    def lora_params(self, r: int, targets: Sequence[str]) -> int:
        """LoRA parameters r x (in + out) for the targeted projections of every layer.

        `targets` may be ``["auto"]`` (the run config's default): the architecture's own choice,
        resolved as the trainer resolves it (:mod:`fedge.lm.targets`).
        """
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        dims = {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        targets = named_targets(",".join(targets), self.model_type, list(dims))
        unknown = [t for t in targets if t not in dims]
        if unknown:
            raise ValueError(
                f"timing-model: no shape for LoRA target(s) {unknown}; known: {list(dims)}"
            )
        return self.layers * sum(r * sum(dims[t]) for t in targets)


def _qwen25_05b() -> ModelShape:
    """Qwen/Qwen2.5-0.5B (config.json: hidden 896, 24 layers, 14 heads, 2 KV heads of 64, I 4864)."""
    h, kv, i, layers, vocab = 896, 128, 4864, 24, 151936
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return ModelShape(
        layers * per_layer + vocab * h + h,
        h,
        layers,
        14,
        kv,
        i,
        vocab,
        tied=True,
        model_type="qwen2",
    )


REFERENCE_MODELS = {"qwen2.5-0.5b": _qwen25_05b()}


def shape_from_model(model: object) -> ModelShape:
    """Read the shape of a loaded Hugging Face causal LM (parameters counted, not estimated)."""
    cfg = model.config  # type: ignore[attr-defined]
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return ModelShape(
        params=int(sum(p.numel() for p in model.parameters())),  # type: ignore[attr-defined]
        hidden=int(cfg.hidden_size),
        layers=int(cfg.num_hidden_layers),
        heads=heads,
        kv_dim=int(getattr(cfg, "num_key_value_heads", heads)) * head_dim,
        intermediate=int(getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)),
        vocab=int(cfg.vocab_size),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


@dataclass(frozen=True)
class Workload:
    """One round of local training: the model, the batch, the adapter, and this machine's speed."""

    shape: ModelShape
    lora_params: int
    batch: int
    seq: int
    local_steps: int
    download_bytes: int  # the train message's arrays (global adapter + strategy payload)
    upload_bytes: int  # the contribution (adapter delta, + control delta for SCAFFOLD)
    optimizer: str = "adamw"  # what the client builds: "adamw" or "sgd" (resolve "auto" first)
    weight_dtype: str = "fp16"
    machine_flops: float = 0.0  # this machine's measured training FLOP/s (0: not calibrated)
    reference_flops: float = FEDSCALE_REFERENCE_FLOPS  # ms/sample's model; 0: this workload's

    def __post_init__(self) -> None:
        """Refuse sizes that cannot be, naming the field."""
        for name in ("batch", "seq", "local_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"workload {name} must be > 0, got {getattr(self, name)}")
        if self.weight_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"weight-dtype must be one of {list(DTYPE_BYTES)}, got {self.weight_dtype!r}"
            )
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(
                f"workload optimizer must be one of {list(OPTIMIZER_STATES)}, got "
                f"{self.optimizer!r} (resolve 'auto' to the strategy's own optimizer first)"
            )
        if self.reference_flops < 0:
            raise ValueError(f"reference_flops must be >= 0, got {self.reference_flops}")

    def flops_per_step(self, batch: int | None = None) -> float:
        """Training FLOPs of one local step at ``batch`` (default: the configured batch)."""
        s, tokens = self.seq, (batch or self.batch) * self.seq
        dense = 4.0 * self.shape.matmul_params + 6.0 * self.lora_params
        attention = 12.0 * self.shape.layers * s * self.shape.hidden
        return tokens * (dense + attention)

    def memory_bytes(self, batch: int | None = None) -> float:
        """Peak training memory at ``batch``: weights, LoRA state, activations, logits."""
        b, s, sh = batch or self.batch, self.seq, self.shape
        states = OPTIMIZER_STATES[self.optimizer]
        weights = sh.params * DTYPE_BYTES[self.weight_dtype]
        lora = self.lora_params * 4.0 * (2.0 + states)
        activations = sh.layers * s * b * sh.hidden * (34.0 + 5.0 * sh.heads * s / sh.hidden)
        logits = 8.0 * b * s * sh.vocab
        return weights + lora + activations + logits

    def step_seconds(self, pop: Population, batch: np.ndarray | int | None = None) -> np.ndarray:
        """Seconds per local step of every device (``batch`` per device or one for all)."""
        b = np.broadcast_to(
            np.asarray(self.batch if batch is None else batch, dtype=np.int64), (len(pop),)
        )
        sizes = np.unique(b)
        per_device = np.array([self.flops_per_step(int(x)) for x in sizes])[
            np.searchsorted(sizes, b)
        ]
        out = np.empty(len(pop), dtype=np.float64)
        k = pop.compute_kind
        out[k == KIND_FLOPS] = per_device[k == KIND_FLOPS] / pop.compute[k == KIND_FLOPS]
        if np.any(k == KIND_SPEED):
            if self.machine_flops <= 0:
                raise ValueError(
                    "the population gives 'speed' relative to this machine, but no step time "
                    "was measured; set calibrate = true (or machine-gflops) in [devices]"
                )
            sel = k == KIND_SPEED
            out[sel] = per_device[sel] / (pop.compute[sel] * self.machine_flops)
        sel = k == KIND_MS_PER_SAMPLE
        ms = pop.compute[sel] / 1000.0
        if self.reference_flops > 0:  # the device's rate on the reference model, applied to ours
            out[sel] = per_device[sel] * ms / self.reference_flops
        else:  # the figures time this very workload (FedScale's own semantics)
            out[sel] = FEDSCALE_TRAIN_FACTOR * b[sel] * ms
        return out

    def with_machine(self, step_seconds: float, flops_per_step: float) -> Workload:
        """A copy calibrated by one measured step time of ``flops_per_step`` FLOPs here."""
        return replace(self, machine_flops=flops_per_step / step_seconds)


def fit_batches(workload: Workload, memory: np.ndarray, shrink: bool) -> np.ndarray:
    """Per device: the configured batch if it fits, else (with ``shrink``) the largest halving that
    fits, else 0 (the device cannot train this model and is excluded)."""
    batch = np.full(len(memory), workload.batch, dtype=np.int64)
    need = workload.memory_bytes()
    batch[memory < need] = 0
    if not shrink:
        return batch
    b = workload.batch // 2
    while b >= 1:
        fits = (batch == 0) & (memory >= workload.memory_bytes(b))
        batch[fits] = b
        b //= 2
    return batch


def measure_step_seconds(
    model_ref: str, train_config: object, steps: int = 3
) -> tuple[float, float]:
    """Time real LoRA training steps of the run's model here; return (seconds per step, FLOPs per step).

    One warm-up step, then the median of ``steps`` timed steps on random tokens, with the
    run's batch, sequence length, precision and an AdamW optimizer over the LoRA tensors.
    """
    import torch

    from fedge.lm import holder
    from fedge.lm.evaluate import autocast_context, lm_batch_loss

    cfg = train_config
    lm = holder.get_lora_model(model_ref, cfg)  # type: ignore[arg-type]
    shape = shape_from_model(lm.model)
    lora = int(sum(p.numel() for p in lm.params.values()))
    batch, seq = int(cfg.batch_size), int(cfg.seq_len)  # type: ignore[attr-defined]
    saved = holder.adapter_arrays(lm)  # the timing steps must not move the cached adapter
    optimizer = torch.optim.AdamW(list(lm.params.values()), lr=1e-6)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (batch, seq + 1), generator=gen).to(lm.device)
    timings = []
    lm.model.train()
    for i in range(steps + 1):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast_context(lm.device, cfg.precision):  # type: ignore[attr-defined]
            loss = lm_batch_loss(lm.model, tokens)
        loss.float().backward()
        optimizer.step()
        if i:
            timings.append(time.perf_counter() - t0)
    optimizer.zero_grad(set_to_none=True)
    holder.set_adapter(lm, saved)
    work = Workload(shape, lora, batch, seq, 1, 0, 0)
    return float(np.median(timings)), work.flops_per_step()
