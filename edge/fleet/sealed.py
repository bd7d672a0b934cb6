"""Sealed values of the fleet's shared state: typed JSON, versioned, authenticated with the fleet key.

What an ingress stores and a controller later acts on (the stable version's `FleetConfig`)
passes through Redis, which every ingress can write: it is sealed, never pickled. A sealed
value is JSON naming its kind and format version, with an HMAC-SHA256 over it under the
fleet key; `unseal` refuses a value of another kind or version, or one whose MAC does not
verify (written by anyone without the key), before parsing anything but the envelope. Reading
a pickled value was code execution for anyone with write access to the store.

The fleet key is 32 random bytes, hex, in a file (mode 0600) that the fleet's processes read at
start (`load_key`): `fedge verifier fleet` writes one into its run directory unless given
`--fleet-key-file`; the ingress, the replicas (to check who a relayed call is for:
`fedge.edge.fleet.relay.sign_identity`) and the rollout controller read the same file. The
key never travels in a deployment argument, an environment variable or the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

FORMAT_VERSION = 1
KEY_BYTES = 32
KEY_FILE = "fleet.key"
T = TypeVar("T")


class SealError(ValueError):
    """A sealed value that is not what it claims: tampered, of another key, kind or version."""


def write_key(path: Path) -> Path:
    """Write a new random fleet key to `path` (mode 0600, never over an existing file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(KEY_BYTES) + "\n")
    return path


def load_key(path: Path) -> bytes:
    """The fleet key in `path` (hex, at least 32 bytes); refuses a file anyone may read."""
    if not path.is_file():
        raise ValueError(f"fleet key file {path} is missing")
    if path.stat().st_mode & stat.S_IROTH:
        raise ValueError(f"fleet key file {path} is readable by every user; chmod 600 it")
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"fleet key file {path} must hold the key in hex") from None
    if len(key) < KEY_BYTES:
        raise ValueError(f"fleet key in {path} has {len(key)} bytes; use {KEY_BYTES} or more")
    return key


def mac(key: bytes, *parts: str) -> str:
    """HMAC-SHA256 under `key` of `parts` (NUL-separated), hex."""
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def seal(kind: str, body: dict[str, Any], key: bytes) -> bytes:
    """`body` (JSON types only) as a sealed value of `kind`."""
    payload = json.dumps(
        {"kind": kind, "version": FORMAT_VERSION, "body": body},
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,
    )
    return json.dumps({"mac": mac(key, payload), "payload": payload}).encode()


def unseal(kind: str, blob: bytes, key: bytes) -> dict[str, Any]:
    """The body of sealed value `blob` of `kind`; SealError unless its MAC, kind and version hold."""
    try:
        envelope = json.loads(blob)
        tag, payload = envelope["mac"], envelope["payload"]
    except (ValueError, TypeError, KeyError):
        raise SealError(f"stored {kind} is not a sealed value") from None
    if not (isinstance(tag, str) and isinstance(payload, str)):
        raise SealError(f"stored {kind} is not a sealed value")
    if not hmac.compare_digest(tag, mac(key, payload)):
        raise SealError(f"stored {kind} fails its MAC: tampered, or sealed with another key")
    inner = json.loads(payload)
    if inner.get("kind") != kind or inner.get("version") != FORMAT_VERSION:
        raise SealError(
            f"stored value is {inner.get('kind')!r} v{inner.get('version')}, "
            f"not {kind!r} v{FORMAT_VERSION}"
        )
    body = inner["body"]
    if not isinstance(body, dict):
        raise SealError(f"stored {kind} has no fields")
    return body


def to_json(value: Any) -> Any:
    """A dataclass (nested ones, paths, tuples included) as JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot seal a {type(value).__name__}")


def from_json(cls: type[T], data: Any) -> T:
    """The dataclass `cls` from `to_json`'s output, each field checked against its annotation;
    unknown fields are refused, missing ones take their defaults."""
    if not isinstance(data, dict):
        raise SealError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - names
    if unknown:
        raise SealError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    values = {name: _typed(hints[name], data[name], f"{cls.__name__}.{name}") for name in data}
    return cls(**values)


def _typed(hint: Any, value: Any, where: str) -> Any:
    """`value` as type `hint` (dataclass, Path, primitives, optionals, tuples, lists)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _typed(arg, value, where)
            except (SealError, TypeError, ValueError) as err:
                errors.append(str(err))
        raise SealError(f"{where}: {value!r} fits none of {hint} ({'; '.join(errors)})")
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise SealError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        items = [_typed(item, v, where) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value)  # type: ignore[arg-type]
    if hint is Path:
        if not isinstance(value, str):
            raise SealError(f"{where}: expected a path, got {value!r}")
        return Path(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (bool, int, float, str):
        if type(value) is not hint:
            raise SealError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    raise SealError(f"{where}: cannot unseal a {hint}")
