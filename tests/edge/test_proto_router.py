"""Generated stubs are reproducible from the proto."""

from __future__ import annotations

from pathlib import Path

from fedge.edge.proto import codegen


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    for generated in codegen.generate(tmp_path):
        committed = codegen.PROTO_DIR / generated.name
        assert generated.read_text() == committed.read_text(), f"{generated.name}: run `make proto`"
