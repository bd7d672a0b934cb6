"""Key agreement, share encryption and secret sharing for SecAgg+: X25519 + HKDF, AES-GCM, Shamir.

Flower's SecAgg primitives use P-384 ECDH, Fernet and pycryptodome's GF(2^128) Shamir
behind a thread pool per call; at a dozen peers per client and 50 clients those dominated
a round. Here: X25519 (about 30x faster per agreement), computed once per peer and key
session (`shared_secret`) with a cheap HKDF per round (`derive`), AES-256-GCM for the
shares, and Shamir over GF(2^521 - 1).
"""

from __future__ import annotations

import os
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

MASK_PURPOSE = b"fedge-secagg pairwise mask"  # HKDF info of the pairwise-mask agreement
SHARE_PURPOSE = b"fedge-secagg share encryption"  # HKDF info of the share-encryption key
_P = 2**521 - 1  # Mersenne prime: the field of the secret sharing
_Y_BYTES = 66  # ceil(521 / 8)
_MAX_SECRET = 64  # the marker byte plus 64 bytes stays below 2^521
_NONCE_BYTES = 12  # AES-GCM's standard nonce


def generate_keypair() -> tuple[bytes, bytes]:
    """Return a fresh X25519 (private, public) key pair as 32 raw bytes each."""
    private = X25519PrivateKey.generate()
    return (
        private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
        private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
    )


def check_public_key(public: bytes) -> None:
    """Raise ValueError unless ``public`` is a raw X25519 public key."""
    X25519PublicKey.from_public_bytes(public)


def pair_info(purpose: bytes, a: int, b: int, round_id: str) -> bytes:
    """HKDF info binding a derived key to its purpose, the pair of node ids and the round."""
    lo, hi = sorted((a, b))
    return b"|".join((purpose, lo.to_bytes(8, "big"), hi.to_bytes(8, "big"), round_id.encode()))


def mask_info(a: int, b: int, round_id: str, digest: bytes) -> bytes:
    """HKDF info of a pair-mask seed: the pair, the round and the digest of the content sent."""
    return pair_info(MASK_PURPOSE, a, b, round_id) + b"|" + digest


def shared_secrets(private: bytes, publics: list[bytes]) -> list[bytes]:
    """Return the raw X25519 secret of ``private`` with each of ``publics`` (32 bytes each).

    The raw secret is as sensitive as the private key: keep it where the key is kept, and
    only ever use it through :func:`derive`.
    """
    key = X25519PrivateKey.from_private_bytes(private)
    return [key.exchange(X25519PublicKey.from_public_bytes(pk)) for pk in publics]


def derive(secret: bytes, purpose: bytes) -> bytes:
    """Return 32 bytes derived from a :func:`shared_secrets` secret by HKDF, bound to ``purpose``.

    ``purpose`` is the HKDF info: give it :func:`pair_info` so that a key derived for one
    pair of node ids and one round is useless for any other.
    """
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose).derive(secret)


def seal(key: bytes, plaintext: bytes, context: bytes) -> bytes:
    """Encrypt and authenticate ``plaintext`` under a 32-byte key with AES-256-GCM.

    ``context`` is authenticated, not sent: the receiver must name the same context (for
    a share, its sender and receiver) or :func:`unseal` fails. Output: nonce || ciphertext.
    """
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, context)


def unseal(key: bytes, sealed: bytes, context: bytes) -> bytes:
    """Decrypt what :func:`seal` made; raise ValueError when it was altered or misaddressed."""
    try:
        return AESGCM(key).decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], context)
    except InvalidTag as exc:
        raise ValueError("ciphertext does not authenticate under this key and context") from exc


def split_secret(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """Shamir-share ``secret`` (at most 64 bytes) into ``num`` shares; ``threshold`` rebuild it.

    The field is GF(p) for the Mersenne prime p = 2^521 - 1, so one share is one field
    element and Python's integers do the arithmetic (pycryptodome's GF(2^128) version
    multiplies bit by bit in Python and dominated a 50-client round). Coefficients come
    from `secrets`. A share is the 2-byte x followed by y as 66 big-endian bytes.
    """
    if not 1 <= threshold <= num < 2**16:
        raise ValueError(f"need 1 <= threshold={threshold} <= num={num} < 65536")
    if len(secret) > _MAX_SECRET:
        raise ValueError(f"secret of {len(secret)} bytes exceeds {_MAX_SECRET}")
    value = int.from_bytes(b"\x01" + secret, "big")  # the marker byte keeps leading zeros
    coeffs = [value] + [secrets.randbelow(_P) for _ in range(threshold - 1)]
    shares = []
    for x in range(1, num + 1):
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % _P
        shares.append(x.to_bytes(2, "big") + y.to_bytes(_Y_BYTES, "big"))
    return shares


def combine_secret(shares: list[bytes]) -> bytes:
    """Rebuild a secret from ``threshold`` distinct shares made by `split_secret`."""
    points = [(int.from_bytes(s[:2], "big"), int.from_bytes(s[2:], "big")) for s in shares]
    xs = [x for x, _ in points]
    if len(set(xs)) != len(xs) or any(len(s) != 2 + _Y_BYTES for s in shares):
        raise ValueError("shares are malformed or repeat an index")
    value = 0
    for j, (xj, yj) in enumerate(points):  # Lagrange interpolation at 0
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % _P
                den = den * (xm - xj) % _P
        value = (value + yj * num * pow(den, -1, _P)) % _P
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    if not raw or raw[0] != 1:
        raise ValueError("the shares do not combine to a secret made by split_secret")
    return raw[1:]
