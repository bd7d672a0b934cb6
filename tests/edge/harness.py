"""Test helpers: per-device credentials, client certificates signed by a test CA, a fleet
ingress running outside Ray Serve."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import secrets
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from edge.fleet.ingress import FleetIngress, IngressSpec

T = TypeVar("T")


def write_credentials(directory: Path, devices: list[str]) -> tuple[Path, dict[str, str]]:
    """A credentials file giving each device a fresh random token; returns it and device -> token."""
    tokens = {device: secrets.token_hex(16) for device in devices}
    path = directory / "credentials"
    path.write_text("# identity token\n" + "".join(f"{d} {t}\n" for d, t in tokens.items()))
    return path, tokens


def client_certificate(
    ca_cert: Path, ca_key: Path, name: str, directory: Path
) -> tuple[Path, Path]:
    """A real client certificate for common name `name`, signed by the CA's key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    issuer = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())  # type: ignore[arg-type]
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class LocalIngress(FleetIngress):
    """The ingress outside Serve: its teardown is awaited by `running_ingress`, not the collector."""

    loop: asyncio.AbstractEventLoop

    def __del__(self) -> None:
        return None

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run one of the ingress's coroutines on its loop (its store's client lives there)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)


class NoReplicas:
    """Stands where Ray Serve's deployment handle is: records each relay, then fails it.

    It observes what the ingress would ship to a replica (no replica is needed to show
    that a refused call ships nothing) and raises what the handle would on a fault that
    takes a cluster to cause (`fail`); with `gate`, a relay first waits for it to open.
    """

    def __init__(self) -> None:
        self.relayed: list[dict[str, str]] = []
        self.fail: Callable[[], BaseException] = lambda: RuntimeError("no replica in this test")
        self.gate: threading.Event | None = None

    @property
    def unary(self) -> NoReplicas:
        return self

    def options(self, **_: Any) -> NoReplicas:
        return self

    async def remote(self, method: str, payload: bytes, metadata: Any, *_: Any, **__: Any) -> Any:
        self.relayed.append(dict(metadata))
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.01)
        raise self.fail()


@contextlib.contextmanager
def running_ingress(spec: IngressSpec) -> Iterator[tuple[LocalIngress, NoReplicas]]:
    """A real fleet ingress (its gRPC server, auth, limits) on a loop thread, relaying to nobody."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    front = LocalIngress.__new__(LocalIngress)  # what Serve does: construct, then await __init__
    front.loop = loop
    asyncio.run_coroutine_threadsafe(front.__init__(spec), loop).result()  # type: ignore[func-returns-value]
    replicas = NoReplicas()
    front._handle = lambda app: replicas  # type: ignore[method-assign]
    try:
        yield front, replicas
    finally:
        asyncio.run_coroutine_threadsafe(FleetIngress.__del__(front), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
