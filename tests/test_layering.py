"""Dependencies point down: every import between fedge's top-level packages follows the layers.

Layers, lowest first: ``fedge`` core <- ``strategies`` <- ``server``, ``clients``, ``edge``
(never each other) <- ``simulations`` <- ``cli`` (the command line and the demo's composition)
and ``bench``, which may import any layer below them but not each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fedge", "strategies", "server", "clients", "edge", "simulations", "cli", "bench")
BELOW_TOP = {"fedge", "strategies", "server", "clients", "edge", "simulations"}
ALLOWED: dict[str, set[str]] = {
    "fedge": {"fedge"},
    "strategies": {"fedge", "strategies"},
    "server": {"fedge", "strategies", "server"},
    "clients": {"fedge", "strategies", "clients"},
    "edge": {"fedge", "strategies", "edge"},
    "simulations": BELOW_TOP,
    "cli": BELOW_TOP | {"cli"},
    "bench": BELOW_TOP | {"bench"},
}


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
        p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py")) if "_pb2" not in p.name
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


def test_the_core_holds_no_entry_point() -> None:
    """The command line and the demo live on the top floor, not in the core they compose."""
    assert not (REPO / "fedge" / "cli.py").exists()
    assert not (REPO / "fedge" / "demo.py").exists()
    assert imported_packages(REPO / "cli" / "main.py") >= {"edge", "server", "simulations"}
