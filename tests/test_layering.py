"""Dependencies point down: every import between fedge's parts follows the layers.

Every part installs under the one import root ``fedge``: the folders ``strategies/``,
``server/``, ... are ``fedge.strategies``, ``fedge.server``, ... (symlinks in ``fedge/``).
Layers, lowest first: the ``fedge`` core (its own modules) <- ``strategies`` <- ``server``,
``clients``, ``edge`` (never each other) <- ``simulations`` <- ``cli`` (the command line and the
demo's composition) and ``bench``, which may import any layer below them but not each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PARTS = ("strategies", "server", "clients", "edge", "simulations", "cli")
PACKAGES = ("fedge", *PARTS, "bench")
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
OLD_ROOT = "old-root"  # a part imported by its folder name, outside the fedge root


def layer_of(module: str) -> str | None:
    """The layer an absolute import names: ``fedge.server.x`` is ``server``, ``fedge.keys`` the core."""
    head, _, rest = module.partition(".")
    if head == "fedge":
        part = rest.split(".")[0]
        return part if part in PARTS else "fedge"
    if head in PARTS:
        return OLD_ROOT
    return "bench" if head == "bench" else None


def imported_packages(path: Path) -> set[str]:
    """The layers a module imports (module level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(layer for n in names if (layer := layer_of(n)) is not None)
    return found


def sources() -> list[Path]:
    """Every Python source of the layered packages, generated stubs excluded."""
    return [
        p
        for pkg in PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
        if "_pb2" not in p.name and not _through_symlink(p)
    ]


def _through_symlink(path: Path) -> bool:
    """True for a file reached through ``fedge/<part>``: it is checked once, under its own folder."""
    return any(parent.is_symlink() for parent in path.relative_to(REPO).parents if parent.parts)


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_imports_point_down(path: Path) -> None:
    """A module imports only its own layer and the layers below it."""
    layer = path.relative_to(REPO).parts[0]
    upward = imported_packages(path) - ALLOWED[layer]
    assert not upward, f"{path.relative_to(REPO)} ({layer}) imports {sorted(upward)} from above"


def test_the_checker_catches_an_upward_import(tmp_path: Path) -> None:
    """A module that imports a higher layer is reported (the check can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from fedge.clients import app\n")
    assert imported_packages(bad) - ALLOWED["server"] == {"clients"}


def test_the_old_top_level_names_are_caught(tmp_path: Path) -> None:
    """An import of ``server`` (not ``fedge.server``) would clash with a user's own module."""
    bad = tmp_path / "bad.py"
    bad.write_text("import strategies.base\n")
    assert imported_packages(bad) - ALLOWED["bench"] == {OLD_ROOT}


@pytest.mark.parametrize("part", PARTS)
def test_every_part_installs_under_the_fedge_root(part: str) -> None:
    """``fedge/<part>`` is the part's folder, so ``fedge.<part>`` imports it and a wheel holds it."""
    link = REPO / "fedge" / part
    assert link.is_symlink() and link.resolve() == (REPO / part).resolve()


def test_the_core_holds_no_entry_point() -> None:
    """The command line and the demo live on the top floor, not in the core they compose."""
    assert not (REPO / "fedge" / "cli.py").exists()
    assert not (REPO / "fedge" / "demo.py").exists()
    assert imported_packages(REPO / "cli" / "main.py") >= {"edge", "server", "simulations"}
