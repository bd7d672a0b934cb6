"""The optional parts' packages: a missing one named with the extra that installs it.

``pip install fedge`` is the core (flwr, torch, numpy, cryptography); ``dp``, ``lora``,
``edge``, ``fleet`` and ``all`` are extras (pyproject.toml). Code of an extra imports its
packages where it needs them and calls :func:`require` first, so a core install says what to
install instead of a bare ``No module named ...``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, or raise ModuleNotFoundError naming ``pip install 'fedge[extra]'``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the package is there but one of its own imports failed: not ours to rename
        raise ModuleNotFoundError(
            f"{what} needs {module.split('.')[0]}, which the core install leaves out: "
            f"pip install 'fedge[{extra}]'",
            name=exc.name,
        ) from exc


def check_installed(package: str, extra: str, what: str) -> None:
    """Like :func:`require` without importing ``package`` (its import may take seconds)."""
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"{what} needs {package}, which the core install leaves out: "
            f"pip install 'fedge[{extra}]'",
            name=package,
        )
