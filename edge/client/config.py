"""How the edge reaches the verifier (`ClientConfig`) and the two ways reaching it can fail."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedge.errors import FedgeError


class VerifierUnreachable(FedgeError):
    """The verifier answered UNAVAILABLE or DEADLINE_EXCEEDED (or not SERVING) for too long."""


class TokenizerMismatch(FedgeError):
    """The verifier's tokenizer is not the draft's: its ids would decode to other text."""


class RateLimited(Exception):
    """The verifier refused a call for this device's rate limit and asked for a longer wait than allowed."""

    def __init__(self, retry_after_s: float, details: str) -> None:
        super().__init__(f"rate limited for {retry_after_s:.3f} s: {details}")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ClientConfig:
    """How the edge reaches the verifier."""

    target: str  # HOST:PORT
    token: str | None = None  # bearer token, when the verifier requires one
    token_file: Path | None = None  # a file holding the token instead (read when connecting)
    root_cert: Path | None = None  # PEM CA of the verifier's certificate; given = TLS
    tls_server_name: str | None = None  # override the name checked against the certificate
    client_cert: Path | None = None  # PEM client certificate and key (mTLS), with root_cert
    client_key: Path | None = None
    timeout_s: float = 30.0  # per call
    added_rtt_s: float = 0.0  # simulated network round trip added to every call
    max_retries: int = 5  # on RESOURCE_EXHAUSTED
    backoff_s: float = 0.01  # first retry delay when the server names none; doubles each retry
    device_id: str | None = None  # sent as `fedge-device` metadata: the key of per-device limits
    max_wait_s: float = 2.0  # longest server-asked retry-after waited out; longer: RateLimited
    unreachable_after_s: float = 3.0  # UNAVAILABLE / DEADLINE_EXCEEDED retried this long
    health_timeout_s: float = 1.0  # a health check slower than this counts as down
    tokenizer_id: str | None = None  # the draft's (fedge.edge.verifier.identity); a verifier with
    # another tokenizer is refused (TokenizerMismatch). None: not checked

    def __post_init__(self) -> None:
        host, _, port = self.target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"ClientConfig.target must be HOST:PORT, got {self.target!r}")
        for name in (
            "timeout_s",
            "added_rtt_s",
            "backoff_s",
            "max_wait_s",
            "unreachable_after_s",
            "health_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"ClientConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.token is not None and self.token_file is not None:
            raise ValueError("ClientConfig.token and token_file are exclusive; give one")
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("ClientConfig.client_cert and client_key must be given together")
        if self.client_cert is not None and self.root_cert is None:
            raise ValueError("ClientConfig.client_cert needs root_cert (mTLS runs over TLS)")
        if self.max_retries < 0:
            raise ValueError(f"ClientConfig.max_retries must be >= 0, got {self.max_retries}")

    def bearer_token(self) -> str | None:
        """The token to send: given, or read from `token_file` (stripped)."""
        if self.token_file is None:
            return self.token
        if not self.token_file.is_file():
            raise FileNotFoundError(f"ClientConfig.token_file {self.token_file} is missing")
        token = self.token_file.read_text().strip()
        if not token:
            raise ValueError(f"ClientConfig.token_file {self.token_file} is empty")
        return token
