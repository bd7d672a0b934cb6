"""Where fedge keeps built artefacts: `$FEDGE_HOME`, else `~/.cache/fedge`."""

from __future__ import annotations

import os
from pathlib import Path

FEDGE_HOME_ENV = "FEDGE_HOME"


def fedge_home() -> Path:
    """Root directory for the zoo, tokenized corpora and other caches."""
    configured = os.environ.get(FEDGE_HOME_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fedge"


def zoo_dir(preset: str) -> Path:
    """Default location of a built zoo preset."""
    return fedge_home() / "zoo" / preset


def corpus_cache_dir() -> Path:
    """Default location of tokenized, memory-mapped client datasets."""
    return fedge_home() / "corpus"
