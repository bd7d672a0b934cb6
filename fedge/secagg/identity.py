"""Long-term client identities of SecAgg+: Ed25519 keys that sign each session's key advertisement.

Without them the server relays X25519 public keys it could have made itself and so
sit in the middle of every pair (Bell et al. 2020 sign the advertisements for this
reason). A node's signing key lives in a file under its own state root, created once
(mode 0600); the operator distributes the public halves out of band as a *trust list*
(one hex key per line, ``#`` comments), as Flower's SuperNode authentication
distributes its public keys. A client accepts a neighbour only with a valid signature,
and, when it holds a trust list, only under a listed key.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

ADVERT_PURPOSE = b"fedge-secagg key advertisement v1"  # domain of an advertisement signature
SHARE_PURPOSE = b"fedge-secagg seed share v1"  # domain of a share signature
PUBLIC_BYTES = 32  # a raw Ed25519 public key
SIGNATURE_BYTES = 64  # a raw Ed25519 signature


def load_or_create(path: Path) -> Ed25519PrivateKey:
    """This node's signing key from ``path`` (raw 32 bytes), created there on first use (0600)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = Ed25519PrivateKey.generate().private_bytes(
            Encoding.Raw, PrivateFormat.Raw, NoEncryption()
        )
        try:  # O_EXCL: two workers starting at once keep one key, never overwrite it
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(raw)
    raw = path.read_bytes()
    if len(raw) != 32:
        raise ValueError(
            f"SecAgg+ identity key {path} has {len(raw)} bytes, not 32; restore it (neighbours "
            "pinned its public key) or, knowingly, delete it and redistribute the trust list"
        )
    return Ed25519PrivateKey.from_private_bytes(raw)


def private_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte private key (what the key file holds)."""
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


@functools.lru_cache(maxsize=256)
def public_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public half of ``key`` (what trust lists hold).

    Cached per key object (a node's key is loaded once per process): deriving the public
    point is a scalar multiplication, about 75 us, and every collect stage needs it."""
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def advert_bytes(session: str, node_id: int, pk1: bytes, pk2: bytes) -> bytes:
    """What an advertisement signature covers: purpose, session, node id and both X25519 keys."""
    return b"|".join((ADVERT_PURPOSE, session.encode(), node_id.to_bytes(8, "big"), pk1, pk2))


def sign_advert(
    key: Ed25519PrivateKey, session: str, node_id: int, pk1: bytes, pk2: bytes
) -> bytes:
    """Sign this node's X25519 keys of ``session``."""
    return key.sign(advert_bytes(session, node_id, pk1, pk2))


def verify_advert(
    identity: bytes, signature: bytes, session: str, node_id: int, pk1: bytes, pk2: bytes
) -> bool:
    """Whether ``signature`` by ``identity`` covers these keys of ``node_id`` in ``session``."""
    try:
        Ed25519PublicKey.from_public_bytes(identity).verify(
            signature, advert_bytes(session, node_id, pk1, pk2)
        )
    except (InvalidSignature, ValueError):
        return False
    return True


def share_bytes(session: str, round_id: str, owner: int, holder: int, share: bytes) -> bytes:
    """What a share signature covers: the round, the seed's owner, the share's holder, the share."""
    return b"|".join(
        (
            SHARE_PURPOSE,
            session.encode(),
            round_id.encode(),
            owner.to_bytes(8, "big"),
            holder.to_bytes(8, "big"),
            share,
        )
    )


def sign_share(
    key: Ed25519PrivateKey, session: str, round_id: str, owner: int, holder: int, share: bytes
) -> bytes:
    """``share`` followed by the owner's signature: what the holder receives and later reveals."""
    return share + key.sign(share_bytes(session, round_id, owner, holder, share))


def verify_share(
    identity: bytes, signed: bytes, session: str, round_id: str, owner: int, holder: int
) -> bytes | None:
    """The share inside ``signed`` when ``identity`` signed it for this holder, else None."""
    share, sig = signed[:-SIGNATURE_BYTES], signed[-SIGNATURE_BYTES:]
    try:
        Ed25519PublicKey.from_public_bytes(identity).verify(
            sig, share_bytes(session, round_id, owner, holder, share)
        )
    except (InvalidSignature, ValueError):
        return None
    return share


def parse_trust_list(text: str, source: str) -> frozenset[bytes]:
    """The public keys of a trust list (hex, one per line, ``#`` comments); bad lines are errors."""
    out = set()
    for number, line in enumerate(text.splitlines(), 1):
        item = line.split("#", 1)[0].strip()
        if not item:
            continue
        try:
            key = bytes.fromhex(item)
        except ValueError:
            key = b""
        if len(key) != PUBLIC_BYTES:
            raise ValueError(
                f"{source}:{number}: not a 64-hex-digit Ed25519 public key; fix or remove the line"
            )
        out.add(key)
    return frozenset(out)


def read_trust_list(path: Path) -> str:
    """The text of a trust list file; a missing file is an error (never an empty, permissive
    list). Parse it with :func:`parse_trust_list`."""
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"SecAgg+ trust list {path}: cannot read it ({exc})") from exc


def format_trust_list(keys: Iterable[bytes]) -> str:
    """A trust list holding ``keys`` (what an operator writes after collecting public keys)."""
    return "".join(f"{k.hex()}\n" for k in sorted(keys))
