"""Draft runtimes on the device: next-token logits with a KV cache kept between steps.

Every runtime holds the KV cache of the tokens it has been fed; `extend` feeds
more and returns the logits after the last one; `truncate` rolls the cache back
after the verifier rejects part of a draft. Backends are chosen by ordered
dispatch (ONNX variants fastest first by measured decode time, then torch): the
first that accepts the source wins; a failure lists every backend and why it declined.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fedge.edge import _hf
from fedge.errors import CorruptModelError, ModelNotFoundError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "fedge-edge-draft/1"


class DraftRuntime(Protocol):
    """What the speculative decoder needs from a draft model on the device."""

    name: str
    vocab_size: int
    max_context: int

    @property
    def length(self) -> int:
        """Tokens currently held in the KV cache."""
        ...

    def extend(self, token_ids: Sequence[int]) -> np.ndarray:
        """Feed tokens (appending their KV); returns float32 logits [V] after the last one."""
        ...

    def truncate(self, length: int) -> None:
        """Roll the KV cache back to its first `length` tokens."""
        ...

    def reset(self) -> None:
        """Forget every token."""
        ...


def _check_extend(runtime: DraftRuntime, token_ids: Sequence[int]) -> None:
    """Refuse an empty feed, ids outside the vocabulary and running past the context."""
    if not token_ids:
        raise ValueError("extend needs at least one token id")
    bad = [t for t in token_ids if not 0 <= t < runtime.vocab_size]
    if bad:
        raise ValueError(
            f"token id {bad[0]} is outside the draft vocabulary [0, {runtime.vocab_size})"
        )
    if runtime.length + len(token_ids) > runtime.max_context:
        raise ValueError(
            f"{runtime.length} + {len(token_ids)} tokens pass the draft's context of "
            f"{runtime.max_context}; reset the runtime or shorten the request"
        )


def _check_truncate(runtime: DraftRuntime, length: int) -> None:
    """Rollback target must lie within what the cache holds."""
    if not 0 <= length <= runtime.length:
        raise ValueError(f"cannot truncate a cache of {runtime.length} tokens to {length}")


class OnnxDraftRuntime:
    """ONNX Runtime session over an exported draft with explicit past/present KV tensors."""

    def __init__(self, onnx_path: Path, manifest: dict, name: str, threads: int = 0) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self._session = ort.InferenceSession(
            str(onnx_path), options, providers=["CPUExecutionProvider"]
        )
        self.name = name
        self.vocab_size = int(manifest["vocab_size"])
        self.max_context = int(manifest["max_context"])
        self._past_names = list(manifest["past_names"])
        self._heads = int(manifest["kv_heads"])
        self._head_dim = int(manifest["head_dim"])
        self._past: list[np.ndarray] = []
        self.reset()

    @property
    def length(self) -> int:
        """Tokens currently held in the KV cache."""
        return int(self._past[0].shape[2])

    def reset(self) -> None:
        """Forget every token: empty past tensors [1, heads, 0, head_dim]."""
        empty = np.zeros((1, self._heads, 0, self._head_dim), dtype=np.float32)
        self._past = [empty for _ in self._past_names]

    def extend(self, token_ids: Sequence[int]) -> np.ndarray:
        """Run the new tokens against the cached past; keep the presents as the new past."""
        _check_extend(self, token_ids)
        feed = {"input_ids": np.asarray([token_ids], dtype=np.int64)}
        feed.update(zip(self._past_names, self._past, strict=True))
        logits, *present = self._session.run(None, feed)
        self._past = present
        return np.asarray(logits[0, -1], dtype=np.float32)

    def truncate(self, length: int) -> None:
        """Slice every past tensor back to `length` positions."""
        _check_truncate(self, length)
        self._past = [p[:, :, :length] for p in self._past]


class TorchDraftRuntime:
    """Eager transformers model with a KV cache; the fallback when no valid ONNX export exists."""

    def __init__(self, model: torch.nn.Module, name: str = "torch") -> None:
        self.model = model.eval()
        self.name = name
        config: Any = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
        self.max_context = int(config.max_position_embeddings)
        self._kv: _hf.KV | None = None

    @property
    def length(self) -> int:
        """Tokens currently held in the KV cache."""
        return _hf.kv_length(self._kv) if self._kv else 0

    def reset(self) -> None:
        """Forget every token."""
        self._kv = None

    @torch.no_grad()
    def extend(self, token_ids: Sequence[int]) -> np.ndarray:
        """Forward the new tokens on the cached KV."""
        _check_extend(self, token_ids)
        logits, self._kv = _hf.forward(self.model, torch.tensor([list(token_ids)]), self._kv)  # type: ignore[arg-type]
        return logits[0, -1].float().numpy()

    def truncate(self, length: int) -> None:
        """Slice the cached keys and values back to `length` positions."""
        _check_truncate(self, length)
        if self._kv is not None:
            self._kv = [(k[:, :, :length], v[:, :, :length]) for k, v in self._kv]


# ---------------------------------------------------------------------- dispatch
def read_manifest(export_dir: Path) -> dict:
    """Load an export's manifest, checking its format tag."""
    path = export_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CorruptModelError(
            f"{path} has format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}; "
            "re-export with `fedge edge export`"
        )
    return manifest


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _onnx_dispatcher(variant: str) -> Callable[[Path, int], DraftRuntime | str]:
    """Build a dispatcher for one ONNX variant of an export directory."""

    def dispatch(source: Path, threads: int) -> DraftRuntime | str:
        if not (source / MANIFEST_NAME).is_file():
            return f"no {MANIFEST_NAME} in {source}"
        manifest = read_manifest(source)
        entry = manifest.get("variants", {}).get(variant)
        if entry is None:
            return f"the export has no {variant} variant"
        if not entry.get("valid", False):
            return f"the {variant} variant failed validation: {entry.get('failures')}"
        path = source / entry["file"]
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != entry["sha256"]:
            raise CorruptModelError(f"{path} does not match its manifest hash; re-export it")
        return OnnxDraftRuntime(path, manifest, name=f"onnx-{variant}", threads=threads)

    return dispatch


def _dispatch_torch(source: Path, threads: int) -> DraftRuntime | str:
    """Load a Hugging Face model directory eagerly (fp32)."""
    if not (source / "config.json").is_file():
        return f"no config.json in {source}"
    from fedge.models import load_causal_lm

    if threads:
        torch.set_num_threads(threads)
    return TorchDraftRuntime(load_causal_lm(source))


RUNTIMES: dict[str, Callable[[Path, int], DraftRuntime | str]] = {
    "onnx-int4": _onnx_dispatcher("int4"),
    "onnx-int8": _onnx_dispatcher("int8"),
    "onnx-fp32": _onnx_dispatcher("fp32"),
    "torch": _dispatch_torch,  # default, last
}


def auto_order(source: Path) -> list[str]:
    """RUNTIMES in order, except that ONNX variants go fastest first by the manifest's decode time.

    Quantized is not always faster: on narrow drafts per-op overhead dominates (see the
    crossover table in docs/edge.md), so the measured `decode_step_s` decides (torch stays
    last, the default).
    """
    names = list(RUNTIMES)
    if not (source / MANIFEST_NAME).is_file():
        return names
    variants = read_manifest(source).get("variants", {})
    onnx = [n for n in names if n.startswith("onnx-")]
    timed = sorted(onnx, key=lambda n: variants.get(n[5:], {}).get("decode_step_s", float("inf")))
    return timed + [n for n in names if n not in onnx]


def load_draft_runtime(source: Path, backend: str = "auto", threads: int = 0) -> DraftRuntime:
    """First runtime that accepts `source` (an export dir or a model dir).

    `backend` names one entry of RUNTIMES to force it, or "auto" to try them in
    `auto_order`: valid ONNX variants fastest first, then torch.
    """
    source = Path(source)
    if not source.exists():
        raise ModelNotFoundError(
            f"draft source {source} does not exist; pass an export directory "
            "(`fedge edge export`) or a Hugging Face model directory"
        )
    if backend != "auto" and backend not in RUNTIMES:
        raise ValueError(
            f"unknown draft backend {backend!r}; choose auto or one of {list(RUNTIMES)}"
        )
    names = auto_order(source) if backend == "auto" else [backend]
    declined = []
    for name in names:
        outcome = RUNTIMES[name](source, threads)
        if not isinstance(outcome, str):
            return outcome
        declined.append(f"{name}: {outcome}")
    raise ModelNotFoundError(f"no draft runtime accepts {source}: " + "; ".join(declined))
