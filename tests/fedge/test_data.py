"""Federated corpus: partitions, the Dirichlet skew, the token cache and bring-your-own data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedge.data import (
    Document,
    FederatedCorpus,
    PartitionSpec,
    build_federated_corpus,
    load_documents,
    partition_documents,
)
from fedge.data.corpus import TOPLEVEL_LABEL, stdlib_sources
from fedge.data.dialect import two_space_indent
from fedge.errors import DataError
from fedge.zoo import ZooPaths

CHARS = 20_000


def test_stdlib_corpus_excludes_tests_and_labels_packages() -> None:
    files = stdlib_sources(max_chars_per_label=CHARS)
    labels = {f.label for f in files}
    assert {"asyncio", "email", "json", TOPLEVEL_LABEL} <= labels
    assert not any(
        "/test/" in f"/{f.path}" or f.path.split("/")[-1].startswith("test_") for f in files
    )
    assert [f.path for f in files] == sorted(f.path for f in files)


def test_natural_partition_is_one_client_per_package(micro_corpus: FederatedCorpus) -> None:
    assert "json" in micro_corpus.client_ids and "email" in micro_corpus.client_ids
    for client_id in micro_corpus.client_ids:
        assert set(micro_corpus.label_counts(client_id)) == {client_id}


@pytest.mark.parametrize("scheme", ["natural", "iid", "dirichlet"])
def test_partitions_are_disjoint_and_cover_the_corpus(scheme: str) -> None:
    docs = load_documents(None, CHARS)
    assignment = partition_documents(docs, PartitionSpec(scheme, num_partitions=8, seed=1))
    indices = [i for members in assignment.values() for i in members]
    assert sorted(indices) == list(range(len(docs)))  # each document exactly once


def _label_concentration(assignment: dict[str, list[int]], labels: list[str]) -> float:
    """Mean over labels (with at least 16 chunks) of the share held by that label's largest client."""
    owner = {i: client for client, members in assignment.items() for i in members}
    shares = []
    for label in set(labels):
        members = [i for i, lab in enumerate(labels) if lab == label]
        if len(members) >= 16:
            counts = np.unique([owner[i] for i in members], return_counts=True)[1]
            shares.append(counts.max() / len(members))
    return float(np.mean(shares))


def test_dirichlet_alpha_controls_label_skew() -> None:
    """Dirichlet draws each label's split over clients: small alpha gives it to few clients,
    large alpha spreads it evenly, as IID does (largest share near 1/8 plus sampling noise)."""
    docs = load_documents(None, CHARS)
    labels = [d.label for d in docs]
    skewed = partition_documents(docs, PartitionSpec("dirichlet", 8, alpha=0.05, seed=3))
    mixed = partition_documents(docs, PartitionSpec("dirichlet", 8, alpha=100.0, seed=3))
    iid = partition_documents(docs, PartitionSpec("iid", 8, seed=3))
    assert _label_concentration(skewed, labels) > _label_concentration(mixed, labels) + 0.3
    assert abs(_label_concentration(mixed, labels) - _label_concentration(iid, labels)) < 0.1


def test_client_tokens_are_memory_mapped_and_cached(
    micro_zoo: ZooPaths, micro_corpus: FederatedCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = micro_corpus.client("json")
    assert isinstance(tokens.train, np.memmap) and isinstance(tokens.heldout, np.memmap)
    assert len(tokens.train) > 0 and len(tokens.heldout) > 0
    index = micro_corpus.directory / "clients.json"
    written = (index.stat().st_ino, index.stat().st_mtime_ns)

    def no_rebuild(*args: object) -> None:
        raise AssertionError("the cached corpus was partitioned and tokenized again")

    monkeypatch.setattr("fedge.data.federated.partition_documents", no_rebuild)
    again = build_federated_corpus(micro_zoo.target_dir, max_chars_per_client=CHARS)
    assert again.directory == micro_corpus.directory
    after = index.stat()
    assert (after.st_ino, after.st_mtime_ns) == written  # the same files, not written again
    assert len(micro_corpus.heldout_union()) == sum(
        len(micro_corpus.client(i).heldout) for i in range(len(micro_corpus))
    )


def test_client_streams_decode_to_their_documents(
    micro_zoo: ZooPaths, micro_corpus: FederatedCorpus
) -> None:
    from fedge.models import load_tokenizer

    tokenizer = load_tokenizer(micro_zoo.target_dir)
    by_path = {d.path: d for d in load_documents(None, CHARS)}
    first: Document = next(
        by_path[p] for p in micro_corpus.documents_of("json") if not by_path[p].heldout
    )
    stream = np.asarray(micro_corpus.client("json").train)
    end = int(np.argmax(stream == tokenizer.eos_token_id))
    assert tokenizer.decode(stream[:end]) == first.text


def test_bring_your_own_directory(micro_zoo: ZooPaths, tmp_path: Path) -> None:
    for client, body in {
        "alice": "def a():\n    return 1\n" * 200,
        "bob": "class B:\n    x = 2\n" * 200,
    }.items():
        (tmp_path / "data" / client).mkdir(parents=True)
        (tmp_path / "data" / client / "notes.txt").write_text(body)
    corpus = build_federated_corpus(
        micro_zoo.target_dir, source=tmp_path / "data", cache_root=tmp_path / "cache"
    )
    assert corpus.client_ids == ["alice", "bob"]
    assert len(corpus.client("bob").train) > 0 and len(corpus.client("bob").heldout) > 0


def test_bring_your_own_jsonl(micro_zoo: ZooPaths, tmp_path: Path) -> None:
    rows = [{"client_id": f"c{i % 3}", "text": f"value_{i} = {i}\n" * 50} for i in range(12)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    corpus = build_federated_corpus(
        micro_zoo.target_dir, source=path, cache_root=tmp_path / "cache"
    )
    assert corpus.client_ids == ["c0", "c1", "c2"]


def test_empty_client_is_rejected_by_name(tmp_path: Path) -> None:
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "a.txt").write_text("x = 1\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("   \n")
    with pytest.raises(DataError, match="'empty'"):
        load_documents(tmp_path)


def test_unreadable_client_file_is_rejected_by_name(tmp_path: Path) -> None:
    (tmp_path / "carol").mkdir()
    (tmp_path / "carol" / "blob.bin").write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(DataError, match=r"'carol'.*blob\.bin"):
        load_documents(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"client_id": "a", "text": "x"}\nnot json\n', r"data.jsonl:2 is not valid JSON"),
        ('{"text": "x"}\n', "needs a string field 'client_id'"),
        ('{"client_id": "a", "text": 3}\n', "needs a string field 'text'"),
        ('{"client_id": "a", "text": "  "}\n', "Client 'a'.*has no text"),
        ("\n\n", "has no records"),
    ],
)
def test_malformed_jsonl_is_rejected_with_its_line(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_documents(path)


def test_unknown_source_kind_says_what_is_expected(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match="one subdirectory of text files per client"):
        load_documents(path)


def test_bad_partition_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match="scheme='zipf'"):
        PartitionSpec("zipf")
    with pytest.raises(ValueError, match="alpha=0"):
        PartitionSpec("dirichlet", alpha=0)


def test_two_space_indent_halves_whole_indentation_levels_only() -> None:
    """Hand-derived: each line's leading 4-space levels become 2 spaces each (17 leading spaces:
    4 levels and 1 of alignment -> 9); spaces inside a line and tab indentation are kept."""
    text = "def f(x):\n    if x:\n        return g(x,\n                 y)  # a    b\n\tz = 1\n"
    assert two_space_indent(text) == (
        "def f(x):\n  if x:\n    return g(x,\n         y)  # a    b\n\tz = 1\n"
    )


def test_the_indent2_corpus_is_the_stdlib_reindented_with_the_same_split() -> None:
    """``corpus:indent2`` holds the same files, labels and train/held-out split as the stdlib
    corpus (""), each file's text re-indented (chunks may be cut elsewhere: lines are shorter),
    line by line; an unknown built-in name is refused, listing the known."""

    def by_file(docs: list[Document]) -> dict[tuple[str, str, bool], str]:
        files: dict[tuple[str, str, bool], str] = {}
        for d in docs:
            key = (d.path.split("#", 1)[0], d.label, d.heldout)
            files[key] = files.get(key, "") + d.text
        return files

    plain = by_file(load_documents("", CHARS))
    indent2 = by_file(load_documents("corpus:indent2", CHARS))
    assert plain.keys() == indent2.keys() and any(held for _, _, held in plain)
    indented = {k for k in plain if re.search(r"^    ", plain[k], re.MULTILINE)}
    assert {k for k in plain if indent2[k] != plain[k]} == indented
    assert len(indented) > 0.8 * len(plain)
    for k in plain:  # line by line: same text after the indentation, 4k + m spaces -> 2k + m
        lines, relined = plain[k].splitlines(), indent2[k].splitlines()
        assert len(lines) == len(relined)
        for a, b in zip(lines, relined, strict=True):
            lead = len(a) - len(a.lstrip(" "))
            assert b == " " * (lead - 2 * (lead // 4)) + a.lstrip(" ")
    assert load_documents("corpus:stdlib", CHARS) == load_documents(None, CHARS)
    with pytest.raises(DataError, match="corpus:stdlib, corpus:indent2"):
        load_documents("corpus:pirate", CHARS)
