"""Key agreement and secret sharing for SecAgg+: X25519 + HKDF, and Shamir over GF(2^128).

Flower's SecAgg primitives use P-384 ECDH and spawn a thread pool for every Shamir call;
at dozens of peers per client both dominate a round, so this module offers the same
operations on X25519 (about 30x faster per agreement) and pycryptodome's Shamir called
directly. Shares keep Flower's layout (4-byte index, then one 16-byte share per chunk).
"""

from __future__ import annotations

import base64

from Crypto.Protocol.SecretSharing import Shamir
from Crypto.Util.Padding import pad, unpad
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

MASK_PURPOSE = b"fedge-secagg pairwise mask"  # HKDF info of the pairwise-mask agreement
SHARE_PURPOSE = b"fedge-secagg share encryption"  # HKDF info of the share-encryption key


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


def agree(private: bytes, public: bytes, purpose: bytes) -> bytes:
    """Return 32 bytes both parties derive from the X25519 secret, bound to ``purpose``."""
    secret = X25519PrivateKey.from_private_bytes(private).exchange(
        X25519PublicKey.from_public_bytes(public)
    )
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose).derive(secret)


def fernet_key(shared: bytes) -> bytes:
    """Encode a 32-byte shared secret as a Fernet key (url-safe base64)."""
    return base64.urlsafe_b64encode(shared)


def split_secret(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """Shamir-share ``secret`` into ``num`` shares, any ``threshold`` of which rebuild it."""
    padded = pad(secret, 16)
    shares = [bytearray(i.to_bytes(4, "little")) for i in range(1, num + 1)]
    for start in range(0, len(padded), 16):
        for index, share in Shamir.split(threshold, num, padded[start : start + 16], ssss=False):
            shares[index - 1] += share
    return [bytes(s) for s in shares]


def combine_secret(shares: list[bytes]) -> bytes:
    """Rebuild a secret from at least ``threshold`` shares made by `split_secret`."""
    chunks = (len(shares[0]) - 4) // 16
    out = bytearray()
    for c in range(chunks):
        parts = [(int.from_bytes(s[:4], "little"), s[4 + 16 * c : 20 + 16 * c]) for s in shares]
        out += Shamir.combine(parts, ssss=False)
    try:
        return unpad(bytes(out), 16)
    except ValueError:
        raise ValueError("the shares do not combine to a padded secret") from None
