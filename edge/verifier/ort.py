"""The verifier's target on ONNX Runtime: a cached export, numpy KV per session, padded batches.

`target_export` writes the served model (base plus the merged federated adapter) once as an
fp32 ONNX graph with explicit past/present KV tensors, an attention mask and position ids
(`fedge.edge.export.export_onnx(masked=True)`), under `$FEDGE_HOME/verifier/onnx/<digest>`,
the digest hashing every weight: a new adapter is new weights, hence a new export. `OrtRuntime`
is the engine's `Runtime` over it: each session's KV is an `OrtKV` of numpy arrays, grown by
each pass's presents, cropped on rejection, and several sessions run as one padded batch
exactly as `fedge.edge.verifier.batching` pads them for torch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from fedge.edge import _hf
from fedge.edge.verifier.batching import KVGeometry
from fedge.edge.verifier.runtime import LocalKVRuntime
from fedge.errors import CorruptModelError, FedgeError
from fedge.paths import fedge_home

LOG = logging.getLogger("fedge.verifier")
EXPORT_FORMAT = "fedge-verifier-onnx/1"  # bump when the graph's inputs or outputs change
TARGET_FILE = "target.onnx"
META_FILE = "export.json"
MAX_RELATIVE_ERROR = 1e-4  # same fp32 math as torch: only kernel rounding (edge export's bar)

__all__ = ["OrtKV", "OrtRuntime", "check_against", "target_export", "weights_digest"]


def weights_digest(model: PreTrainedModel) -> str:
    """SHA-256 of the model's config, every parameter and buffer (names, dtypes, shapes, bytes).

    Hashed after the adapter merge, so the key of an export changes with the adapter.
    """
    digest = hashlib.sha256(EXPORT_FORMAT.encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        if data.data_ptr() in seen:  # a tied weight: its name says it, the bytes are hashed once
            continue
        seen.add(data.data_ptr())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def exports_root() -> Path:
    """Where the verifier keeps its target exports."""
    return fedge_home() / "verifier" / "onnx"


def target_export(model: PreTrainedModel, root: Path | None = None) -> Path:
    """The export directory of `model`'s exact weights, exporting it first if none is cached.

    Concurrent builders (replicas starting together) each export into their own scratch
    folder and the first rename wins; a half-written export is never seen.
    """
    from fedge.edge.export import _geometry, export_onnx

    digest = weights_digest(model)
    root = Path(root) if root is not None else exports_root()
    out = root / digest[:32]
    if _complete(out, digest):
        return out
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
    try:
        target = model
        if next(model.parameters()).dtype != torch.float32:  # the export is fp32
            target = copy.deepcopy(model).float()
        started = time.perf_counter()
        past_names = export_onnx(target, scratch / TARGET_FILE, masked=True)
        meta = {
            "format": EXPORT_FORMAT,
            "digest": digest,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "export_s": round(time.perf_counter() - started, 2),
            "past_names": past_names,
            "torch": torch.__version__,
            **_geometry(target),
        }
        (scratch / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        LOG.info("exported the verifier target to ONNX in %.1f s: %s", meta["export_s"], out)
        try:
            os.rename(scratch, out)
        except OSError:  # another process finished first (or a stale folder is there)
            if not _complete(out, digest):
                shutil.rmtree(out, ignore_errors=True)
                os.rename(scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _complete(folder: Path, digest: str) -> bool:
    """True when `folder` holds a finished export of the weights hashed to `digest`."""
    meta = folder / META_FILE
    if not meta.is_file() or not (folder / TARGET_FILE).is_file():
        return False
    found = json.loads(meta.read_text())
    return bool(found.get("format") == EXPORT_FORMAT and found.get("digest") == digest)


@dataclass
class _Layer:
    """One layer's key and value, as torch views of the arrays (what `_hf.cache_to_kv` reads)."""

    keys: torch.Tensor
    values: torch.Tensor


class OrtKV:
    """One session's KV for the ONNX target: key and value arrays [1, heads, L, head_dim] per layer.

    It answers the cache calls the engine makes of a DynamicCache (`get_seq_length`, `crop`,
    `update`, `layers`), and `nbytes` counts the memory its arrays keep alive (a cropped
    array is a view of its longer parent until the next pass replaces it).
    """

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays  # key_0, value_0, key_1, value_1, ...

    def get_seq_length(self, layer: int = 0) -> int:
        return int(self.arrays[0].shape[2])

    def crop(self, max_length: int) -> None:
        """DynamicCache semantics: a negative `max_length` drops that many last positions."""
        length = max_length if max_length >= 0 else self.get_seq_length() + max_length
        self.arrays = [a[:, :, : max(length, 0)] for a in self.arrays]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> None:
        """Append positions [1, heads, T, head_dim] to one layer."""
        for slot, new in ((2 * layer, key), (2 * layer + 1, value)):
            self.arrays[slot] = np.concatenate([self.arrays[slot], new.numpy()], axis=2)

    @property
    def layers(self) -> list[_Layer]:
        pairs = zip(self.arrays[0::2], self.arrays[1::2], strict=True)
        return [_Layer(torch.from_numpy(k), torch.from_numpy(v)) for k, v in pairs]

    @property
    def nbytes(self) -> int:
        return sum((a.base if isinstance(a.base, np.ndarray) else a).nbytes for a in self.arrays)


class OrtRuntime(LocalKVRuntime):
    """The engine's runtime on an ONNX Runtime session over `target_export`'s graph (CPU)."""

    def __init__(self, export: Path, threads: int = 0, passive: bool = True) -> None:
        import onnxruntime as ort

        meta = json.loads((Path(export) / META_FILE).read_text())
        if meta.get("format") != EXPORT_FORMAT:
            raise CorruptModelError(
                f"{export} holds a {meta.get('format')!r} export, expected {EXPORT_FORMAT!r}; "
                "delete it and the verifier exports again"
            )
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        # no busy-waiting between ops: the worker shares the cores with gRPC's threads, which a
        # spinning pool thread starves (as OMP_WAIT_POLICY=PASSIVE keeps torch's from doing)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0" if passive else "1")
        options.log_severity_level = 3
        self.session = ort.InferenceSession(
            str(Path(export) / TARGET_FILE), options, providers=["CPUExecutionProvider"]
        )
        self.export = Path(export)
        self.past_names: list[str] = list(meta["past_names"])
        self.geometry = KVGeometry(
            int(meta["num_layers"]), int(meta["kv_heads"]), int(meta["head_dim"]), torch.float32
        )

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def _empty(self, rows: int = 1, length: int = 0) -> np.ndarray:
        geo = self.geometry
        return np.zeros((rows, geo.heads, length, geo.head_dim), dtype=np.float32)

    def _run(
        self, input_ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        feed = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
        feed.update(zip(self.past_names, past, strict=True))
        logits, *present = self.session.run(None, feed)
        return logits, present

    def prefill(
        self, tokens: Sequence[int], want_logits: bool = False
    ) -> tuple[OrtKV, torch.Tensor | None]:
        cache = OrtKV([self._empty() for _ in self.past_names])
        logits = None
        if tokens:
            logits = self.forward_on(torch.tensor([list(tokens)]), cache)
        return cache, (logits[:, -1:] if want_logits and logits is not None else None)

    def forward_on(self, input_ids: torch.Tensor, cache: OrtKV) -> torch.Tensor:
        ids = input_ids.numpy().astype(np.int64, copy=False)
        past, new = cache.get_seq_length(), ids.shape[1]
        mask = np.ones((1, past + new), dtype=np.int64)
        positions = np.arange(past, past + new, dtype=np.int64)[None, :]
        logits, cache.arrays = self._run(ids, mask, positions, cache.arrays)
        return torch.from_numpy(logits)

    def batchable(self, cache: Any) -> bool:
        return True

    def batched_forward(
        self, caches: Sequence[Any], inputs: list[list[int]]
    ) -> tuple[torch.Tensor, _hf.KV]:
        """`fedge.edge.verifier.batching.batched_forward`'s padding, on the ONNX graph.

        Pasts left-padded to the longest P, inputs right-padded to the longest T; the mask
        hides both paddings and positions continue each session's own length. The caches are
        not changed; returns logits [B, T, V] and per layer the new positions' keys and values.
        """
        lengths = [cache.get_seq_length() for cache in caches]
        counts = [len(tokens) for tokens in inputs]
        size, longest_past, longest_new = len(inputs), max(lengths), max(counts)
        ids = np.zeros((size, longest_new), dtype=np.int64)
        mask = np.zeros((size, longest_past + longest_new), dtype=np.int64)
        for b, tokens in enumerate(inputs):
            ids[b, : counts[b]] = tokens
            mask[b, longest_past - lengths[b] : longest_past + counts[b]] = 1
        positions = np.asarray(lengths, dtype=np.int64)[:, None] + np.arange(longest_new)[None, :]
        padded = []
        for slot in range(len(self.past_names)):  # one copy of each session's past
            block = self._empty(size, longest_past)
            for b, cache in enumerate(caches):
                if lengths[b]:
                    block[b, :, longest_past - lengths[b] :] = cache.arrays[slot][0]
            padded.append(block)
        logits, present = self._run(ids, mask, positions, padded)
        new = [torch.from_numpy(p[:, :, longest_past:]) for p in present]
        return torch.from_numpy(logits), list(zip(new[0::2], new[1::2], strict=True))


def check_against(runtime: OrtRuntime, model: PreTrainedModel, vocab: int) -> float:
    """Logit error of the export against the torch model on a probe (prefill, cached steps).

    Returns the worst position's max |onnx - torch| over that row's spread; raises FedgeError
    above MAX_RELATIVE_ERROR (the export would not be lossless against the torch path).
    """
    probe = [(7 * i + 3) % vocab for i in range(12)]
    with torch.inference_mode():
        reference = model(input_ids=torch.tensor([probe])).logits[0].float().numpy()
    cache, _ = runtime.prefill(probe[:8])
    rows = [runtime.forward_on(torch.tensor([[t]]), cache)[0, -1].numpy() for t in probe[8:]]
    got, want = np.stack(rows), reference[8:]
    spread = np.maximum(want.max(-1) - want.min(-1), 1e-12)
    error = float((np.abs(got - want).max(-1) / spread).max())
    if error > MAX_RELATIVE_ERROR:
        raise FedgeError(
            f"the ONNX export at {runtime.export} differs from the torch model (relative logit "
            f"error {error:.3g} > {MAX_RELATIVE_ERROR}); serve with runtime torch"
        )
    return error
