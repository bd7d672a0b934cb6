"""The benches run as documented: `python bench/<name>.py` from the repo root, or `-m bench.<name>`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
PROJECT = ("bench", "clients", "edge", "fedge", "server", "simulations", "strategies")
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "__main__" in p.read_text())


def _bootstrap_line(tree: ast.Module) -> int | None:
    """Line of the module-level ``if not __package__: import _bootstrap``, if there is one."""
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and ast.unparse(node.test) == "not __package__"
            and any(
                isinstance(s, ast.Import) and s.names[0].name == "_bootstrap" for s in node.body
            )
        ):
            return node.lineno
    return None


def _project_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import of the project's packages, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
    return [(line, m) for line, m in found if m.split(".")[0] in PROJECT]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_bench_script_puts_the_repo_root_first_before_importing_the_project(script: Path) -> None:
    """Run as a script, bench/ is first on sys.path (its edge.py shadows `edge`, `bench` is
    missing): `_bootstrap` must come before the first project import (the privacy bench
    stopped with ModuleNotFoundError: No module named 'bench' without it)."""
    tree = ast.parse(script.read_text())
    line = _bootstrap_line(tree)
    assert line is not None, f"{script.name} lacks `if not __package__: import _bootstrap`"
    early = [(n, m) for n, m in _project_imports(tree) if n < line]
    assert not early, f"{script.name} imports {early} before the bootstrap"


def test_no_bench_imports_another_that_imports_it_back() -> None:
    """Shared helpers live in bench/_common.py (privacy.py and privacy_sweep.py imported each other)."""
    graph = {
        p.stem: {
            m.split(".")[1]
            for _, m in _project_imports(ast.parse(p.read_text()))
            if m.startswith("bench.")
        }
        | {
            a.name
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == "bench"
            for a in node.names
        }
        for p in BENCH.glob("*.py")
    }
    cycles = [(a, b) for a, deps in graph.items() for b in deps if a in graph.get(b, set())]
    assert cycles == []


def test_interleaved_blocks_give_every_arm_the_same_mean_position() -> None:
    """ABBA: under a steady drift of the machine each arm's blocks sit, on average, at the same
    time of the run (run back to back, A's blocks all came before B's, and run 2 of the fleet
    bench put the token-aware arm on a machine 1.3x slower than its one-replica run)."""
    from bench._common import block_order

    order = block_order(("round-robin", "token-aware"), 4)
    assert [arm for _, arm in order] == [
        "round-robin",
        "token-aware",
        "token-aware",
        "round-robin",
    ] * 2
    assert [block for block, _ in order] == [0, 0, 1, 1, 2, 2, 3, 3]
    for arm in ("round-robin", "token-aware"):
        assert sum(i for i, (_, a) in enumerate(order) if a == arm) / 4 == 3.5
    assert [arm for _, arm in block_order(("a", "b", "c"), 2)] == ["a", "b", "c", "c", "b", "a"]
