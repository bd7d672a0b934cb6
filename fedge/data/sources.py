"""Where client documents come from: a built-in corpus, a directory per client, or a JSONL file.

Every document carries a label: its stdlib package, or the client id of bring-your-own data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fedge.data.corpus import is_heldout, stdlib_sources
from fedge.data.dialect import BUILTIN_CORPORA
from fedge.errors import DataError
from fedge.names import CORPUS_PREFIX

CHUNK_CHARS = 4000  # partitioning unit: small enough that Dirichlet draws have items to move


@dataclass(frozen=True)
class Document:
    """One text with its natural client label and its fixed train/held-out assignment."""

    path: str  # "<file>#<chunk>": chunks of one file share the file's split
    label: str
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.path.split("#", 1)[0])


def chunk_document(path: str, label: str, text: str, size: int = CHUNK_CHARS) -> list[Document]:
    """Cut a text at line boundaries into pieces of about `size` characters."""
    pieces: list[str] = []
    current: list[str] = []
    length = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            pieces.append("".join(current))
            current, length = [], 0
    if current:
        pieces.append("".join(current))
    return [Document(f"{path}#{k}", label, piece) for k, piece in enumerate(pieces)]


def load_documents(
    source: Path | str | None, max_chars_per_client: int | None = None
) -> list[Document]:
    """Documents of the stdlib corpus (`source` None or ""), a built-in ``corpus:<name>``
    (:mod:`fedge.data.dialect`), a client-per-directory tree or a JSONL file."""
    if not source or str(source).startswith(CORPUS_PREFIX):
        name = str(source or CORPUS_PREFIX + "stdlib").removeprefix(CORPUS_PREFIX)
        if name not in BUILTIN_CORPORA:
            raise DataError(
                f"Data source {source!r} names no built-in corpus; choose one of "
                f"{', '.join(CORPUS_PREFIX + known for known in BUILTIN_CORPORA)}."
            )
        transform = BUILTIN_CORPORA[name]
        files = stdlib_sources(max_chars_per_label=max_chars_per_client)
        return [d for f in files for d in chunk_document(f.path, f.label, transform(f.text))]
    source = Path(source)
    if source.is_dir():
        docs = _from_directory(source)
    elif source.is_file() and source.suffix in {".jsonl", ".json"}:
        docs = _from_jsonl(source)
    else:
        raise DataError(
            f"Data source {source} is neither a directory (one subdirectory of text files per "
            'client) nor a .jsonl file (one {"client_id", "text"} object per line).'
        )
    return _cap_per_label(docs, max_chars_per_client)


def _cap_per_label(docs: list[Document], max_chars: int | None) -> list[Document]:
    if max_chars is None:
        return docs
    used: dict[str, int] = {}
    kept = []
    for doc in docs:
        if used.get(doc.label, 0) < max_chars:
            used[doc.label] = used.get(doc.label, 0) + len(doc.text)
            kept.append(doc)
    return kept


def _from_directory(root: Path) -> list[Document]:
    """One client per subdirectory; every regular file below it is read as UTF-8 text."""
    stray = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    if stray:
        raise DataError(
            f"{root} holds files at its top level ({', '.join(stray[:3])}); put each client's "
            "files in a subdirectory named after the client."
        )
    clients = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not clients:
        raise DataError(f"{root} has no client subdirectories; create one per client.")
    docs: list[Document] = []
    for client in clients:
        client_docs = [
            doc
            for f in sorted(client.rglob("*"))
            if f.is_file() and not f.name.startswith(".")
            for doc in chunk_document(
                f.relative_to(root).as_posix(), client.name, _read_text(f, client.name)
            )
        ]
        _require_text(client.name, client_docs, str(client))
        docs.extend(client_docs)
    return docs


def _read_text(path: Path, client: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(
            f"Client {client!r}: cannot read {path} as UTF-8 text ({err}); fix or remove the file."
        ) from err


def _from_jsonl(path: Path) -> list[Document]:
    """One JSON object per line with string fields `client_id` and `text`."""
    by_client: dict[str, list[Document]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"Cannot read {path} as UTF-8 JSONL ({err}).") from err
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number} is not valid JSON ({err}).") from err
        if not isinstance(row, dict) or not isinstance(row.get("client_id"), str | int):
            raise DataError(f"{path}:{number} needs a string field 'client_id'.")
        if not isinstance(row.get("text"), str):
            raise DataError(
                f"{path}:{number} (client {row['client_id']!r}) needs a string field 'text'."
            )
        client = str(row["client_id"])
        by_client.setdefault(client, []).extend(
            chunk_document(f"{client}/{number}", client, row["text"])
        )
    if not by_client:
        raise DataError(
            f'{path} has no records; write one {{"client_id", "text"}} object per line.'
        )
    for client, client_docs in by_client.items():
        _require_text(client, client_docs, str(path))
    return [doc for client in sorted(by_client) for doc in by_client[client]]


def _require_text(client: str, docs: list[Document], where: str) -> None:
    if not any(doc.text.strip() for doc in docs):
        raise DataError(f"Client {client!r} in {where} has no text; add data or remove the client.")
