"""Process-wide state that code under test sets in process, and its undoing."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

_IDENTITY = ("_task_id", "_run_id", "_node_id")


@contextlib.contextmanager
def process_state_restored() -> Iterator[None]:
    """Undo what the block left in os.environ and Flower's TaskIdentity.

    Code under test sets both for good reasons (`fedge.simulations.runner` sets FEDGE_CONCURRENCY for
    the client apps; the in-process engine sets the ServerApp's task identity), so nothing run
    in a test's process may change what a later test sees.
    """
    environ = dict(os.environ)
    identity = _task_identity()
    saved = {name: getattr(identity, name) for name in _IDENTITY} if identity else {}
    try:
        yield
    finally:
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        identity = identity or _task_identity()
        if identity is not None:
            for name in _IDENTITY:
                setattr(identity, name, saved.get(name))


def _task_identity() -> Any:
    """flwr's TaskIdentity class if flwr is already imported (importing it costs a test nothing)."""
    module = sys.modules.get("flwr.supercore.task_identity")
    return getattr(module, "TaskIdentity", None)
