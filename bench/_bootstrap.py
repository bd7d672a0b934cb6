"""Imported first by a bench run as ``python bench/x.py``: make the repo importable, as ``-m`` does.

Run as a script, Python puts ``bench/`` first on ``sys.path``: there ``bench/edge.py`` shadows the
``edge`` package and ``bench`` itself is not importable. The repo root takes its place (``bench/``
moves to the end), and goes on ``PYTHONPATH`` too, for the processes a bench starts (Ray workers
unpickle ``bench.*``; spawned device processes re-run the script).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# bench/ goes last, not away: a process a bench spawns (multiprocessing) re-runs the script,
# whose `import _bootstrap` must still resolve there, and `edge` must still be the package
sys.path[:] = (
    [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH] + [str(BENCH)]
)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
