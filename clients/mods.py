"""One app-level Flower mod that applies the mods the run's config names, chosen per call.

``ClientApp(mods=[...])`` is fixed when the module is imported, but which mods a run
wants (SecAgg+, distributed-DP clipping and noise, ...) is configuration. So the
ClientApp installs :func:`dispatch_mods` only, and it reads ``client-mods`` from the
message's ``config`` ConfigRecord (falling back to the run config) on every call:
a comma-separated list of ``"package.module:mod"`` paths, applied outermost first,
each a Flower mod ``mod(msg, context, call_next) -> Message``.

Contract for mods: a mod that handles a message itself (e.g. a SecAgg+ key-setup
stage, recognised by its own ConfigRecord key) returns a reply without calling
``call_next``; a mod that post-processes the ``contribution`` ArrayRecord of a train
reply must keep its keys, shapes and float32 dtype (see :mod:`fedge.keys`).
Every message the server sends carries the ``config`` record, so mods are found
under both ``flwr run`` and ``run_simulation`` (whose run config is empty).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedge import keys
from fedge.plugins import load_dotted


def configured_mod_paths(msg: Message, context: Context) -> list[str]:
    """Return the mod paths named by ``client-mods`` in the message config or the run config."""
    raw: object = ""
    if msg.has_content() and keys.REC_CONFIG in msg.content.config_records:
        raw = msg.content.config_records[keys.REC_CONFIG].get(keys.CFG_CLIENT_MODS, "")
    if not raw:
        raw = context.run_config.get(keys.CFG_CLIENT_MODS, "")
    if not isinstance(raw, str):
        raise ValueError(f"config key '{keys.CFG_CLIENT_MODS}' must be a string, got {raw!r}")
    return [p.strip() for p in raw.split(",") if p.strip()]


@functools.lru_cache(maxsize=32)
def _resolve(path: str) -> Mod:
    """Import one mod by dotted path (cached per worker process)."""
    return load_dotted(path, what=f"client mod (config key '{keys.CFG_CLIENT_MODS}')")  # type: ignore[return-value]


def dispatch_mods(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Apply the configured mods around ``call_next`` (outermost first)."""
    handler: ClientAppCallable = call_next
    for path in reversed(configured_mod_paths(msg, context)):
        handler = _wrap(_resolve(path), handler)
    return handler(msg, context)


def _wrap(mod: Mod, inner: ClientAppCallable) -> Callable[[Message, Context], Message]:
    """Bind ``inner`` as the ``call_next`` of ``mod``."""

    def call(msg: Message, context: Context) -> Message:
        return mod(msg, context, inner)

    return call
