"""Test helpers: per-device credentials files and client certificates signed by a test CA."""

from __future__ import annotations

import datetime
import secrets
from pathlib import Path


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
