"""Federated datasets: per-client train and held-out token streams, tokenized once and memory-mapped.

Loading a client's data in a round is an `np.load(mmap_mode="r")`, not a re-tokenization.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge.data.partition import PartitionSpec, partition_documents
from fedge.data.sources import Document, load_documents
from fedge.errors import DataError
from fedge.paths import corpus_cache_dir

HELDOUT_FALLBACK = 0.1  # a client whose files all fall on one side of the split keeps its tail 10%
_INDEX = "clients.json"


@dataclass(frozen=True)
class ClientTokens:
    """One client's data: 1-D token streams, documents joined by the end-of-text token."""

    client_id: str
    train: np.ndarray
    heldout: np.ndarray


class FederatedCorpus:
    """A partitioned, tokenized corpus on disk; clients by index or by id."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = json.loads((directory / _INDEX).read_text())
        self.spec: dict[str, Any] = index["spec"]
        self.clients: list[dict[str, Any]] = index["clients"]
        self.client_ids: list[str] = [c["client_id"] for c in self.clients]

    def __len__(self) -> int:
        return len(self.clients)

    def client(self, key: int | str) -> ClientTokens:
        """Memory-map one client's streams; `key` is a partition index or a client id."""
        position = self._position(key)
        stem = self.directory / f"{position:04d}"
        return ClientTokens(
            client_id=self.client_ids[position],
            train=np.load(f"{stem}.train.npy", mmap_mode="r"),
            heldout=np.load(f"{stem}.heldout.npy", mmap_mode="r"),
        )

    def heldout_union(self) -> np.ndarray:
        """All clients' held-out streams, concatenated in client order."""
        return np.concatenate([np.asarray(self.client(i).heldout) for i in range(len(self))])

    def documents_of(self, key: int | str) -> list[str]:
        """Paths of the documents assigned to one client."""
        documents: list[str] = self.clients[self._position(key)]["documents"]
        return documents

    def label_counts(self, key: int | str) -> dict[str, int]:
        """How many documents of each label one client holds (the partition's skew)."""
        counts: dict[str, int] = self.clients[self._position(key)]["labels"]
        return counts

    def _position(self, key: int | str) -> int:
        if isinstance(key, int):
            if not 0 <= key < len(self):
                raise DataError(
                    f"Client index {key} is out of range: there are {len(self)} clients."
                )
            return key
        try:
            return self.client_ids.index(key)
        except ValueError:
            raise DataError(
                f"Unknown client {key!r}; known clients: {', '.join(self.client_ids[:10])}..."
            ) from None


def build_federated_corpus(
    tokenizer_dir: str | Path,
    scheme: str = "natural",
    num_partitions: int | None = None,
    alpha: float = 0.5,
    seed: int = 0,
    source: Path | str | None = None,
    max_chars_per_client: int | None = None,
    cache_root: Path | None = None,
) -> FederatedCorpus:
    """Partition and tokenize documents once; later calls with the same inputs reuse the cache."""
    from fedge.models import load_tokenizer

    spec = PartitionSpec(scheme, num_partitions, alpha, seed)
    docs = load_documents(source, max_chars_per_client)
    tokenizer = load_tokenizer(tokenizer_dir)
    key = _cache_key(docs, spec, tokenizer.backend_tokenizer.to_str())
    directory = (cache_root or corpus_cache_dir()) / key
    if (directory / _INDEX).is_file():
        return FederatedCorpus(directory)
    assignment = partition_documents(docs, spec)
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    eos = int(tokenizer.eos_token_id)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.int32
    clients = []
    for position, (client_id, indices) in enumerate(assignment.items()):
        client_docs = [docs[i] for i in indices]
        encoded = tokenizer([d.text for d in client_docs], add_special_tokens=False)["input_ids"]
        train, heldout = _split_streams(client_docs, encoded, eos, dtype)
        if len(train) < 2 or len(heldout) < 2:
            raise DataError(f"Client {client_id!r} has too little text to train and evaluate on.")
        np.save(staging / f"{position:04d}.train.npy", train)
        np.save(staging / f"{position:04d}.heldout.npy", heldout)
        clients.append(
            {
                "client_id": client_id,
                "documents": [d.path for d in client_docs],
                "labels": dict(Counter(d.label for d in client_docs)),
                "train_tokens": len(train),
                "heldout_tokens": len(heldout),
            }
        )
    (staging / _INDEX).write_text(json.dumps({"spec": asdict(spec), "clients": clients}))
    shutil.rmtree(directory, ignore_errors=True)
    staging.replace(directory)
    return FederatedCorpus(directory)


def _split_streams(
    docs: list[Document], encoded: list[list[int]], eos: int, dtype: type[np.generic]
) -> tuple[np.ndarray, np.ndarray]:
    """Train/held-out streams by the path-hash rule, falling back to a tail split."""

    def stream(pairs: list[list[int]]) -> np.ndarray:
        return np.fromiter((t for ids in pairs for t in [*ids, eos]), dtype=dtype)

    train = stream([ids for d, ids in zip(docs, encoded, strict=True) if not d.heldout])
    heldout = stream([ids for d, ids in zip(docs, encoded, strict=True) if d.heldout])
    if len(train) and len(heldout):
        return train, heldout
    whole = stream(encoded)
    cut = int(len(whole) * (1 - HELDOUT_FALLBACK))
    return whole[:cut], whole[cut:]


def _cache_key(docs: list[Document], spec: PartitionSpec, tokenizer_json: str) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(asdict(spec), sort_keys=True).encode())
    digest.update(hashlib.sha256(tokenizer_json.encode()).digest())
    for doc in docs:
        digest.update(f"{doc.path}\0{doc.label}\0".encode())
        digest.update(hashlib.sha256(doc.text.encode()).digest())
    return f"{spec.scheme}-{digest.hexdigest()[:16]}"
