"""Session fixtures shared by every test area: the micro zoo and a natural-partition corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("FEDGE_HOME", str(REPO / ".fedge-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see the Makefile

MICRO_CHARS_PER_CLIENT = 20_000  # the micro zoo's own corpus size per package


@pytest.fixture(scope="session")
def micro_zoo():  # type: ignore[no-untyped-def]
    """The micro zoo, built once per cache directory and verified against its manifests."""
    from fedge.zoo import ensure_zoo

    return ensure_zoo("micro")


@pytest.fixture(scope="session")
def micro_corpus(micro_zoo):  # type: ignore[no-untyped-def]
    """The natural (one client per stdlib package) partition, tokenized with the micro tokenizer."""
    from fedge.data import build_federated_corpus

    return build_federated_corpus(
        micro_zoo.target_dir, scheme="natural", max_chars_per_client=MICRO_CHARS_PER_CLIENT
    )
