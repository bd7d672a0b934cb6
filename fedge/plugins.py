"""Plug-ins named in configuration as ``"package.module:attr"`` (server-side and local config only)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def load_dotted(path: str, what: str) -> Callable[..., object]:
    """Import ``"package.module:attr"`` and return the attribute, naming the config key on failure."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} is neither a built-in name nor 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({exc})") from exc
    if not hasattr(module, attr):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is not callable")
    return obj  # type: ignore[no-any-return]
