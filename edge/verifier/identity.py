"""What a verifier serves, as digests: its weights, its adapter, its tokenizer.

A session's version is `model_id/adapter_id`; a reopen names it so that it returns
to the weights it was opened on, and a verifier serving other weights refuses it
(`VersionGone`) instead of continuing the sequence with another model. The
tokenizer's digest lets the edge refuse a verifier whose vocabulary differs from
its draft's: the same size with other ids would decode to plausible wrong text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.manifest import MANIFEST_NAME, sha256_file

ID_CHARS = 16  # hex characters kept of each sha256
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "merges.txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True)
class ServingIdentity:
    """Digests of the served target: weights, merged adapter ("" for none), tokenizer."""

    model_id: str = ""
    adapter_id: str = ""
    tokenizer_id: str = ""

    @property
    def version(self) -> str:
        """The session version these weights serve: `model_id/adapter_id`."""
        return f"{self.model_id}/{self.adapter_id}"


def directory_id(directory: Path) -> str:
    """Digest of a model or adapter directory: its fedge manifest when it has one, else its
    config and weight files (name and content)."""
    if not directory.is_dir():  # weights handed over in memory: nothing to name them by
        return ""
    manifest = directory / MANIFEST_NAME
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()[:ID_CHARS]
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and (path.suffix in WEIGHT_SUFFIXES or path.name.endswith("config.json")):
            digest.update(f"{path.name}:{sha256_file(path)}\n".encode())
    return digest.hexdigest()[:ID_CHARS]


def tokenizer_id(tokenizer: Any) -> str:
    """Digest of a tokenizer's vocabulary (token -> id) and its special tokens' ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted(
        (name, getattr(tokenizer, f"{name}_id", None)) for name in ("bos_token", "eos_token")
    )
    payload = json.dumps([vocab, specials], ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:ID_CHARS]


def tokenizer_dir_id(directory: Path) -> str:
    """`tokenizer_id` of the tokenizer saved in `directory`, or "" when it holds none."""
    if not directory.is_dir() or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return ""
    from transformers import AutoTokenizer

    return tokenizer_id(AutoTokenizer.from_pretrained(directory))


def serving_identity(model_dir: Path, adapter_dir: Path | None = None) -> ServingIdentity:
    """The identity of `model_dir` (plus `adapter_dir`) as a verifier serves it."""
    return ServingIdentity(
        directory_id(model_dir),
        directory_id(adapter_dir) if adapter_dir is not None else "",
        tokenizer_dir_id(model_dir),
    )
