"""What the fleet bench sets up around the fleet: TLS and per-device tokens.

The certificate is a real self-signed one for localhost and the tokens are random; the
local Redis of several ingresses is `fedge.simulations.local_services.redis_server`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from fedge.simulations.local_services import self_signed_cert


@dataclass(frozen=True)
class Secure:
    """TLS pair and credentials file of the ingress; each device's token, in device order."""

    cert: Path
    key: Path
    credentials: Path
    tokens: tuple[str, ...]


def secure_material(directory: Path, devices: int) -> Secure:
    """A self-signed localhost certificate and a credentials file of `devices` random tokens."""
    cert_path, key_path = self_signed_cert(directory)
    tokens = tuple(secrets.token_hex(16) for _ in range(devices))
    credentials = directory / "devices"
    credentials.write_text("".join(f"device-{i} {t}\n" for i, t in enumerate(tokens)))
    return Secure(cert_path, key_path, credentials, tokens)
