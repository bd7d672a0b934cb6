"""Dependencies point down: every import between fedge's top-level packages follows the layers.

Layers, lowest first: ``fedge`` core <- ``strategies`` <- ``server``, ``clients``, ``edge``
(never each other) <- ``simulations`` <- ``bench``. The CLI modules of ``fedge`` sit on top
and may import any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fedge", "strategies", "server", "clients", "edge", "simulations")
ALLOWED: dict[str, set[str]] = {
    "fedge": {"fedge"},
    "strategies": {"fedge", "strategies"},
    "server": {"fedge", "strategies", "server"},
    "clients": {"fedge", "strategies", "clients"},
    "edge": {"fedge", "strategies", "edge"},
    "simulations": set(PACKAGES),
}
TOP_LAYER = {"fedge/cli.py", "fedge/demo.py"}  # entry points wiring every layer together


def imported_packages(path: Path) -> set[str]:
    """The fedge top-level packages a module imports (module level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES)
    return found


def sources() -> list[Path]:
    """Every Python source of the layered packages, generated stubs excluded."""
    return [
        p
        for pkg in PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
        if "_pb2" not in p.name and p.relative_to(REPO).as_posix() not in TOP_LAYER
    ]


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_imports_point_down(path: Path) -> None:
    """A module imports only its own layer and the layers below it."""
    layer = path.relative_to(REPO).parts[0]
    upward = imported_packages(path) - ALLOWED[layer]
    assert not upward, f"{path.relative_to(REPO)} ({layer}) imports {sorted(upward)} from above"


def test_the_checker_catches_an_upward_import(tmp_path: Path) -> None:
    """A module that imports a higher layer is reported (the check can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from clients import app\n")
    assert imported_packages(bad) - ALLOWED["server"] == {"clients"}
