"""Names the server gives client-side data, models and state: identifiers, resolved under node roots.

The server never names a path on a client. For each key below it sends an identifier (the
last component of its own path, a ``zoo:<preset>``, a ``corpus:<name>`` or a hub id); the client resolves it under
a root its own operator sets (node config, else environment, else ``$FEDGE_HOME``) and refuses
an absolute name, a ``..`` step, or a name whose real path (symlinks followed) leaves the root.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedge import keys
from fedge.paths import fedge_home
from fedge.types import ConfigValue


@dataclass(frozen=True)
class RootKind:
    """One kind of root: its node-config key, its environment variable and its default."""

    node_key: str
    env: str
    default: str  # under $FEDGE_HOME


DATA = RootKind("data-root", "FEDGE_DATA_ROOT", "data")
MODELS = RootKind("model-root", "FEDGE_MODEL_ROOT", "models")
STATE = RootKind("state-root", "FEDGE_STATE_ROOT", "client-state")

# Every config key whose value names something on the client's disk, and its root.
NAMED_KEYS: Mapping[str, RootKind] = {
    keys.CFG_DATA_SOURCE: DATA,
    keys.CFG_MODEL: MODELS,
    keys.CFG_DISTILL_TEACHER: MODELS,
    keys.CFG_CLIENT_STATE_DIR: STATE,
}
ZOO_PREFIX = "zoo:"
CORPUS_PREFIX = "corpus:"  # data-source "corpus:<name>": a built-in corpus (fedge.data.dialect)


def _root_key(key: str) -> str:
    """The node-config key of the root a config key's name lives under (run-id: the state's)."""
    return NAMED_KEYS.get(key, STATE).node_key


_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class UnsafeName(ValueError):
    """A server-supplied name that does not resolve inside this node's roots."""


def wire_name(value: str) -> str:
    """What the server sends for one of its own paths: its last component (zoo/hub ids as given)."""
    if not value or value.startswith((ZOO_PREFIX, CORPUS_PREFIX)):
        return value
    path = Path(value).expanduser()
    return path.resolve().name if path.is_absolute() or path.exists() else value


def wire_names(config: Mapping[str, object]) -> dict[str, object]:
    """The client config with every named key reduced to its identifier (:func:`wire_name`)."""
    return {k: wire_name(str(v)) if k in NAMED_KEYS else v for k, v in config.items()}


def roots(kind: RootKind, node_config: Mapping[str, object]) -> list[Path]:
    """This node's roots of one kind (``os.pathsep``-separated), real paths, in search order."""
    raw = str(node_config.get(kind.node_key, "") or os.environ.get(kind.env, ""))
    parts = [p for p in raw.split(os.pathsep) if p] or [str(fedge_home() / kind.default)]
    return [Path(p).expanduser().resolve() for p in parts]


def check_identifier(key: str, value: str) -> None:
    """Refuse an absolute name or one with a ``..`` (or empty) step."""
    if value.startswith(("/", "\\", "~")) or Path(value).is_absolute():
        raise UnsafeName(
            f"config key '{key}' = {value!r} is an absolute path; the server names data, models "
            "and state only by identifiers under this node's roots: send the name relative to "
            f"the root (node config '{_root_key(key)}' sets it)"
        )
    if any(part in ("..", ".", "") for part in value.replace("\\", "/").split("/")):
        raise UnsafeName(
            f"config key '{key}' = {value!r} has a '..' or empty step; send a plain identifier "
            f"under the root that node config '{_root_key(key)}' sets"
        )


def inside(key: str, root: Path, value: str) -> Path | None:
    """``root/value`` with symlinks followed when it exists, refused when it leaves ``root``."""
    candidate = root / value
    if not candidate.exists() and not candidate.is_symlink():
        return None
    real = candidate.resolve()
    if not real.is_relative_to(root):
        raise UnsafeName(
            f"config key '{key}' = {value!r} resolves to {real}, outside this node's root {root} "
            "(a symlink leads out of it); replace the link by the data itself, or name another "
            f"root in node config '{_root_key(key)}'"
        )
    return real


def resolve_existing(key: str, value: str, search: Sequence[Path]) -> Path | None:
    """The first root holding ``value`` (checked with :func:`inside`), else None."""
    check_identifier(key, value)
    for root in search:
        found = inside(key, root, value)
        if found is not None:
            return found
    return None


def resolve_model(key: str, value: str, node_config: Mapping[str, object]) -> str:
    """A model name: ``zoo:<preset>``, a directory under the model roots, or a hub id."""
    if value.startswith(ZOO_PREFIX):
        preset = value.removeprefix(ZOO_PREFIX)
        if not _PLAIN.match(preset):
            raise UnsafeName(f"config key '{key}' = {value!r}: a zoo preset is a plain name")
        return value
    search = roots(MODELS, node_config)
    found = resolve_existing(key, value, search)
    if found is not None:
        return str(found)
    if _HUB_ID.match(value) and not Path(value).exists():
        return value  # a hub id: transformers' own cache, never a local directory
    raise UnsafeName(
        f"config key '{key}' = {value!r} is neither under this node's model roots "
        f"({', '.join(map(str, search))}) nor a hub id; put the model there or set node config "
        f"'{MODELS.node_key}'"
    )


def resolve_data(key: str, value: str, node_config: Mapping[str, object]) -> str:
    """A data source: "" (the stdlib corpus), a built-in ``corpus:<name>``, or a directory/JSONL
    file under the data roots."""
    if not value:
        return ""
    if value.startswith(CORPUS_PREFIX):
        from fedge.data.dialect import BUILTIN_CORPORA

        if value.removeprefix(CORPUS_PREFIX) not in BUILTIN_CORPORA:
            raise UnsafeName(
                f"config key '{key}' = {value!r} names no built-in corpus; choose one of "
                f"{', '.join(CORPUS_PREFIX + name for name in BUILTIN_CORPORA)}"
            )
        return value
    search = roots(DATA, node_config)
    found = resolve_existing(key, value, search)
    if found is None:
        raise UnsafeName(
            f"config key '{key}' = {value!r} is not under this node's data roots "
            f"({', '.join(map(str, search))}); put the data there or set node config "
            f"'{DATA.node_key}'"
        )
    return str(found)


def resolve_state(value: str, run_id: str, node_config: Mapping[str, object]) -> Path | None:
    """The client-state directory ``<state-root>/<value>/<run-id>``, or None ("" = node Context)."""
    key = keys.CFG_CLIENT_STATE_DIR
    if not value:
        return None
    check_identifier(key, value)
    if not _PLAIN.match(run_id):
        raise UnsafeName(
            f"config key '{keys.CFG_RUN_ID}' = {run_id!r} is not a plain name (letters, digits, "
            "'_', '.', '-'); it names a directory under this node's state root"
        )
    root = roots(STATE, node_config)[0]
    found = inside(key, root, value)
    base = found if found is not None else root / value
    run_dir = inside(keys.CFG_RUN_ID, base, run_id)
    return run_dir if run_dir is not None else base / run_id


def resolve_config(
    config: Mapping[str, ConfigValue], node_config: Mapping[str, object]
) -> dict[str, ConfigValue]:
    """The message config with every named key resolved to a path under this node's roots.

    ``model-path`` from the server is dropped; the resolved model is put there instead, so
    :func:`fedge.lm.holder.client_model_ref` only ever sees a path this node chose. The state
    names are checked here too, before anything is loaded.
    """
    out = dict(config)
    out.pop(keys.CFG_MODEL_PATH, None)
    model = str(config.get(keys.CFG_MODEL, "zoo:micro"))
    out[keys.CFG_MODEL] = resolve_model(keys.CFG_MODEL, model, node_config)
    out[keys.CFG_MODEL_PATH] = out[keys.CFG_MODEL]
    teacher = str(config.get(keys.CFG_DISTILL_TEACHER, ""))
    if teacher:
        out[keys.CFG_DISTILL_TEACHER] = resolve_model(
            keys.CFG_DISTILL_TEACHER, teacher, node_config
        )
    out[keys.CFG_DATA_SOURCE] = resolve_data(
        keys.CFG_DATA_SOURCE, str(config.get(keys.CFG_DATA_SOURCE, "")), node_config
    )
    run_id = str(config.get(keys.CFG_RUN_ID, "")) or "unnamed-run"
    resolve_state(
        str(config.get(keys.CFG_CLIENT_STATE_DIR, "")), run_id, node_config
    )  # refuse early
    return out


def roots_for(config: Mapping[str, object]) -> dict[str, str]:
    """Environment that makes a node resolve ``config``'s server paths to themselves: each
    kind's roots are the parent directories of those paths (for one operator running every
    node on its own machine, as ``fedge simulate`` does)."""
    found: dict[str, list[str]] = {}
    for key, kind in NAMED_KEYS.items():
        value = str(config.get(key, ""))
        if value and wire_name(value) != value:
            parent = str(Path(value).expanduser().resolve().parent)
            found.setdefault(kind.env, [])
            if parent not in found[kind.env]:
                found[kind.env].append(parent)
    return {env: os.pathsep.join(parents) for env, parents in found.items()}
