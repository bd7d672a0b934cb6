"""File manifests: sha256 of every file in a directory, so a partial or corrupt copy is detected."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fedge.errors import CorruptModelError

MANIFEST_NAME = "fedge_manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _listed_files(directory: Path) -> list[Path]:
    """Files to hash: everything but the manifest itself and hidden build state."""
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.name != MANIFEST_NAME
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def write_manifest(directory: Path, extra: dict[str, object] | None = None) -> dict[str, object]:
    """Hash every file under `directory` and write the manifest beside them; return it."""
    files = {
        p.relative_to(directory).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in _listed_files(directory)
    }
    manifest: dict[str, object] = {"format": 1, "files": files, **(extra or {})}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_manifest(directory: Path) -> dict[str, object] | None:
    """The manifest of `directory`, or None when it has none."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CorruptModelError(
            f"{path} is not valid JSON ({err}); rebuild the directory."
        ) from err
    if not isinstance(loaded, dict) or not isinstance(loaded.get("files"), dict):
        raise CorruptModelError(f"{path} has no 'files' table; rebuild the directory.")
    return loaded


def verify_manifest(directory: Path) -> list[str]:
    """Problems found in `directory` against its manifest (empty list: intact).

    A directory without a manifest reports that as its one problem.
    """
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"{directory} has no {MANIFEST_NAME}"]
    problems: list[str] = []
    files: dict[str, dict[str, object]] = manifest["files"]  # type: ignore[assignment]
    for name, entry in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(
                f"{name} has {path.stat().st_size} bytes, manifest says {entry['bytes']}"
            )
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{name} does not match its sha256")
    return problems


def require_intact(directory: Path) -> None:
    """Raise CorruptModelError naming every problem when `directory` does not match its manifest."""
    problems = verify_manifest(directory)
    if problems:
        raise CorruptModelError(
            f"Model directory {directory} is incomplete or corrupt: {'; '.join(problems)}. "
            "Rebuild it (`fedge models build --force`) or point at an intact copy."
        )
