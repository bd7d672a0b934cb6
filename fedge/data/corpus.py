"""The built-in corpus: Python standard-library source files, labelled by top-level package.

Every machine with Python has this text, so models and federated data can be built offline.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

TOPLEVEL_LABEL = "_toplevel"  # single-file modules (argparse.py, ...) share one label
HELDOUT_MODULUS = 20  # one file in twenty (by path hash) is held out: about 5%

_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
)


@dataclass(frozen=True)
class SourceFile:
    """One corpus document: its relative path, package label and text."""

    path: str
    label: str
    text: str

    @property
    def heldout(self) -> bool:
        """Whether this file belongs to the held-out split (a fixed function of its path)."""
        return is_heldout(self.path)


def is_heldout(path: str) -> bool:
    """Assign a path to the held-out split by hash, so the split never depends on ordering."""
    digest = hashlib.sha256(path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_MODULUS == 0


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(relative: Path) -> bool:
    parts = relative.parts
    if any(part in _EXCLUDED_DIRS for part in parts[:-1]):
        return True
    name = parts[-1]
    return name.startswith("test_") or name == "conftest.py" or parts[0].startswith("config-")


def _label_of(relative: Path) -> str:
    return relative.parts[0] if len(relative.parts) > 1 else TOPLEVEL_LABEL


def stdlib_sources(
    root: Path | None = None, max_chars_per_label: int | None = None
) -> list[SourceFile]:
    """Read the standard library's `.py` files (tests excluded), sorted by path for determinism.

    `max_chars_per_label` keeps only the first files of each package up to that many characters,
    which gives small presets a corpus with every label present.
    """
    base = root or stdlib_root()
    files: list[SourceFile] = []
    used: dict[str, int] = {}
    for path in sorted(base.rglob("*.py")):
        relative = path.relative_to(base)
        if _is_excluded(relative):
            continue
        label = _label_of(relative)
        if max_chars_per_label is not None and used.get(label, 0) >= max_chars_per_label:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        used[label] = used.get(label, 0) + len(text)
        files.append(SourceFile(path=relative.as_posix(), label=label, text=text))
    return files


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """Split documents into (train, heldout) by the path-hash rule."""
    train = [f for f in files if not f.heldout]
    heldout = [f for f in files if f.heldout]
    return train, heldout
