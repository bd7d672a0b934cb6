"""Who is calling: per-device credentials, checked first, before tracing, limits or any work.

A credentials file maps bearer tokens to device identities, one device per line:
`IDENTITY TOKEN` (blank lines and `#` comments ignored). It is read once, when a
server starts; tokens are kept only as SHA-256 digests. A call's identity is what
its token maps to, or, behind TLS with client certificates (mTLS) and no token,
its certificate's common name. That identity, never the self-asserted
`fedge-device` header, keys the rate limits, the session quota and session
ownership; the header is only a label.

`Authenticator` is a grpc.aio server interceptor. Placed first, it refuses a call
without valid credentials UNAUTHENTICATED before its body is parsed, traced,
charged or relayed, and runs the accepted call with `CALLER` set to its identity.
A fleet replica's private verifier trusts one caller more: the replica itself,
holding a secret made at its start (`relay_secret`), which names the identity the
fleet's ingress authenticated in `fedge-identity` metadata.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import grpc

AUTH_HEADER = "authorization"
IDENTITY_KEY = "fedge-identity"  # metadata: the identity a fleet replica's relay vouches for
BEARER = "bearer "
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
IDENTITY = re.compile(r"[A-Za-z0-9_.@:-]{1,128}")
MIN_TOKEN_CHARS = 16  # 96+ random bits; shorter tokens are refused when the file is read
INDEX_BYTES = 8  # digest prefix that indexes the credentials
CERT_NAME_KEY = "x509_common_name"  # grpc auth context property of a verified client certificate

CALLER: ContextVar[str | None] = ContextVar("fedge_caller", default=None)
"""The authenticated identity of the call being handled (None: the server requires none)."""


def _digest(token: str) -> bytes:
    """SHA-256 of a token: the only form in which tokens are kept."""
    return hashlib.sha256(token.encode()).digest()


class Credentials:
    """Token -> device identity, kept as SHA-256 digests of the tokens."""

    def __init__(self, entries: Sequence[tuple[bytes, str]]) -> None:
        # index by the digest's first bytes; the whole digest is then compared in constant time
        self._index: dict[bytes, list[tuple[bytes, str]]] = {}
        for digest, identity in entries:
            self._index.setdefault(digest[:INDEX_BYTES], []).append((digest, identity))
        self._count = len(entries)

    @classmethod
    def inline(cls, tokens: Mapping[str, str]) -> Credentials:
        """Credentials of a token -> identity mapping given on a command line or in code."""
        if any(not token.strip() for token in tokens):
            raise ValueError("a bearer token must not be blank; omit it to disable auth")
        return cls([(_digest(token), identity) for token, identity in tokens.items()])

    @staticmethod
    def merged(*parts: Credentials) -> Credentials:
        """One set of credentials holding every part's entries."""
        return Credentials([entry for part in parts for entry in part.entries()])

    def entries(self) -> list[tuple[bytes, str]]:
        """(token digest, identity) pairs."""
        return [entry for bucket in self._index.values() for entry in bucket]

    @classmethod
    def load(cls, path: Path) -> Credentials:
        """Read a credentials file: `IDENTITY TOKEN` per line; errors name the file and line."""
        if not path.is_file():
            raise FileNotFoundError(
                f"credentials file {path} is missing; write one 'IDENTITY TOKEN' line per device"
            )
        owners: dict[bytes, str] = {}
        for number, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            where = f"{path}:{number}"
            if len(fields) != 2:
                raise ValueError(f"{where}: expected 'IDENTITY TOKEN', got {len(fields)} fields")
            identity, token = fields
            _check_entry(token, identity, where)
            digest = _digest(token)
            if digest in owners:
                raise ValueError(f"{where}: this token is already given to {owners[digest]!r}")
            owners[digest] = identity
        if not owners:
            raise ValueError(f"{path} holds no credentials; write one 'IDENTITY TOKEN' per line")
        return cls(list(owners.items()))

    def identify(self, token: str) -> str | None:
        """The identity `token` belongs to, or None.

        The digest's first bytes pick candidates (timing then depends on the digest of
        what the caller sent, which tells nothing about a stored token); each candidate's
        whole digest is compared with `hmac.compare_digest`, in constant time.
        """
        digest = _digest(token)
        found = None
        for stored, identity in self._index.get(digest[:INDEX_BYTES], ()):
            if hmac.compare_digest(stored, digest):
                found = identity
        return found

    def __len__(self) -> int:
        return self._count


def token_identity(token: str) -> str:
    """The identity of a token given inline, without a name: `token:` and its digest's start."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def _check_entry(token: str, identity: str, where: str) -> None:
    """An identity is 1-128 of [A-Za-z0-9_.@:-]; a token is at least MIN_TOKEN_CHARS long."""
    if not IDENTITY.fullmatch(identity):
        raise ValueError(
            f"{where}: identity {identity[:40]!r} must be 1-128 characters of [A-Za-z0-9_.@:-]"
        )
    if len(token) < MIN_TOKEN_CHARS or token != token.strip():
        raise ValueError(
            f"{where}: the token of {identity!r} is under {MIN_TOKEN_CHARS} characters or has "
            "spaces; use 32 random hex characters"
        )


def bearer_token(metadata: Sequence[tuple[str, Any]]) -> str:
    """The token of the call's `authorization: Bearer <token>` metadata ("" without one)."""
    for key, value in metadata:
        if key == AUTH_HEADER and isinstance(value, str) and value.lower().startswith(BEARER):
            return value[len(BEARER) :]
    return ""


def _metadata_value(metadata: Sequence[tuple[str, Any]], wanted: str) -> str | None:
    """The first string value of `wanted` in the metadata."""
    for key, value in metadata:
        if key == wanted and isinstance(value, str):
            return value
    return None


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
Resolve = Callable[[grpc.aio.ServicerContext], str | None]


class Authenticator(grpc.aio.ServerInterceptor):
    """Refuses calls without valid credentials; runs the others with `CALLER` set (health stays open).

    `credentials`: token -> identity. `certificates`: the transport verified a client
    certificate (mTLS); a call without a token is its certificate's common name.
    `relay_secret`: a token that may name the identity in `fedge-identity` metadata.
    """

    def __init__(
        self,
        credentials: Credentials | None = None,
        certificates: bool = False,
        relay_secret: str | None = None,
    ) -> None:
        if credentials is None and not certificates and relay_secret is None:
            raise ValueError(
                "Authenticator needs credentials, client certificates or a relay secret"
            )
        self._credentials = credentials
        self._certificates = certificates
        self._relay = _digest(relay_secret) if relay_secret is not None else None

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or unknown credentials: send metadata 'authorization: Bearer <token>' "
                "with this device's token (or a client certificate the server trusts)",
            )

        # no deserializer: a refused call's body is never parsed
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)  # type: ignore[arg-type]

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        metadata = tuple(handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        resolve = self._resolver(metadata)
        if resolve is None:
            return self._deny_stream if method.endswith("/Generate") else self._deny_unary
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return _as_caller(handler, resolve, self._deny_unary)

    def _resolver(self, metadata: Sequence[tuple[str, Any]]) -> Resolve | None:
        """How to name the caller (from metadata now, or from its certificate later); None: refuse."""
        token = bearer_token(metadata)
        if token:
            if self._relay is not None and hmac.compare_digest(_digest(token), self._relay):
                vouched = _metadata_value(metadata, IDENTITY_KEY) or ""
                return lambda context: vouched
            identity = self._credentials.identify(token) if self._credentials else None
            if identity is not None:
                return lambda context: identity
            return None
        if self._certificates:
            return _certificate_name
        return None


def _certificate_name(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the caller's verified client certificate, as `cert:<name>`."""
    names = context.auth_context().get(CERT_NAME_KEY) or []
    return f"cert:{names[0].decode()}" if names else None


def _as_caller(
    handler: grpc.RpcMethodHandler, resolve: Resolve, deny: grpc.RpcMethodHandler
) -> grpc.RpcMethodHandler:
    """The handler run with `CALLER` set to the caller's identity (refused when it has none)."""
    refuse = deny.unary_unary

    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            identity = resolve(context)
            if identity is None:
                return await refuse(request, context)
            reset = CALLER.set(identity)
            try:
                return await unary(request, context)
            finally:
                CALLER.reset(reset)

        return grpc.unary_unary_rpc_method_handler(
            unary_call,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def stream_call(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            identity = resolve(context)
            if identity is None:
                await refuse(request, context)
                return
            reset = CALLER.set(identity)
            try:
                async for reply in stream(request, context):
                    yield reply
            finally:
                CALLER.reset(reset)

        return grpc.unary_stream_rpc_method_handler(
            stream_call,  # type: ignore[arg-type]
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    raise TypeError("Authenticator guards unary and server-streaming methods only")


def server_credentials(
    cert: Path, key: Path, client_ca: Path | None = None
) -> grpc.ServerCredentials:
    """TLS credentials from PEM files read now; with `client_ca`, clients must show a certificate it signed."""
    for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_client_ca", client_ca)):
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"{name} {path} is missing; give a PEM file")
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca is not None else None,
        require_client_auth=client_ca is not None,
    )
