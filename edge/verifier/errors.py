"""Engine errors; the servicer maps each to one gRPC status code."""

from __future__ import annotations

from fedge.errors import FedgeError

VERSION_GONE_KEY = "fedge-version-gone"  # trailing metadata of VersionGone: the version served


class VerifierError(FedgeError):
    """Base class of errors the verifier engine raises on a request."""


class SessionNotFound(VerifierError):
    """Unknown, closed, expired or evicted session (NOT_FOUND)."""


class InvalidRequest(VerifierError):
    """A request field is out of range (INVALID_ARGUMENT); the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class SessionBusy(VerifierError):
    """A verify is already in flight on this session (FAILED_PRECONDITION)."""


class LengthMismatch(VerifierError):
    """A verify's expected_length disagrees with the session and is no retry (ABORTED)."""


class Overloaded(VerifierError):
    """Queue full or KV memory cap reached (RESOURCE_EXHAUSTED, with a retry-after)."""

    def __init__(self, message: str, retry_after_s: float = 0.1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(VerifierError):
    """The engine is not running: loading or draining (UNAVAILABLE)."""


class VersionGone(VerifierError):
    """A reopen names a model version this verifier does not serve (FAILED_PRECONDITION)."""

    def __init__(self, wanted: str, served: str) -> None:
        super().__init__(
            f"version: this session was opened on {wanted!r}, which is no longer served (now "
            f"{served!r}); reopen without a version to continue on it from your committed tokens"
        )
        self.served = served
