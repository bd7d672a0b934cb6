"""What the ingress sends a replica and what it answers when the relay itself fails.

Metadata: the caller's credentials stay in the ingress; the replica learns whom a call
is for from `fedge-identity`, which it believes only with the ingress's signature
(`fedge-identity-sig`: an HMAC under the fleet key over the identity, the method, the
session and the time, `sign_identity`), so a process that reaches a replica through Ray
without passing the ingress cannot name another device's identity (`check_identity`). Failures of the relay (not of the call: those come back
as values) map to the status that tells the edge what to do: a replica that died
takes its sessions with it (NOT_FOUND: reopen from the committed tokens, the proto's
recovery); a full queue is RESOURCE_EXHAUSTED with a retry-after; anything else
(a bug, a timeout inside Ray) is UNAVAILABLE, which the edge retries with the same
idempotent request, so a session that still exists is not re-prefilled. Admission
bounds the calls the ingress holds at once: beyond it a call is refused at once,
RESOURCE_EXHAUSTED with a retry-after, instead of queueing in the ingress's memory
until deadlines expire.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import time
from collections.abc import Iterator, Sequence

from google.protobuf import descriptor
from google.protobuf.message import Message
from opentelemetry import propagate

from fedge.edge.fleet.wire import CallResult, Metadata, ReplicaStopping, clean_metadata
from fedge.edge.verifier.auth import AUTH_HEADER, CALLER, IDENTITY_KEY, bearer_token, token_identity
from fedge.edge.verifier.limits import RETRY_AFTER_KEY

TRACE_KEYS = frozenset({"traceparent", "tracestate"})  # W3C context the ingress re-injects
IDENTITY_SIG_KEY = "fedge-identity-sig"  # metadata: "<unix time>.<hmac>" of the identity
SIGNATURE_MAX_AGE_S = 300.0  # a relayed call's signature is refused this long after signing
PRIVATE_KEYS = frozenset({AUTH_HEADER, IDENTITY_KEY, IDENTITY_SIG_KEY})  # never relayed as sent
BUSY_RETRY_S = 0.1  # retry-after of a call refused for a full queue (a few verify passes)
GONE, BUSY, FAILED = "gone", "busy", "failed"
SESSION_FIELD = "session_id"
SESSION_KEY_CHARS = 16  # 64 bits of a session key: collisions among live sessions are negligible
INT_TYPES = (descriptor.FieldDescriptor.TYPE_INT32, descriptor.FieldDescriptor.TYPE_INT64)


def caller_identity(pairs: Sequence[tuple[str, str | bytes]]) -> str:
    """Who the call is for: the identity the ingress authenticated, else (an open ingress) a
    digest of the bearer token sent, else the anonymous ""."""
    caller = CALLER.get()
    if caller is not None:
        return caller
    token = bearer_token(pairs)
    return token_identity(token) if token else ""


def _identity_mac(key: bytes, identity: str, method: str, session_id: str, stamp: str) -> str:
    parts = ("fedge-identity", identity, method, session_id, stamp)
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def sign_identity(
    key: bytes, identity: str, method: str, session_id: str, now: float | None = None
) -> str:
    """The ingress's signature of a relayed call: `identity` may call `method` on `session_id`."""
    stamp = str(int(time.time() if now is None else now))
    return f"{stamp}.{_identity_mac(key, identity, method, session_id, stamp)}"


def check_identity(
    key: bytes,
    metadata: Sequence[tuple[str, str | bytes]],
    method: str,
    session_id: str,
    now: float | None = None,
) -> str | None:
    """Why the relayed call's identity is not the ingress's (None: it is): no signature, one
    over another identity, method or session, or one older than `SIGNATURE_MAX_AGE_S`."""
    values = {k: v.decode() if isinstance(v, bytes) else v for k, v in metadata}
    identity, signature = values.get(IDENTITY_KEY, ""), values.get(IDENTITY_SIG_KEY, "")
    stamp, _, tag = signature.partition(".")
    if not stamp.isdigit() or not tag:
        return "the relayed call carries no identity signed by the fleet's ingress"
    age = (time.time() if now is None else now) - int(stamp)
    if not -60.0 <= age <= SIGNATURE_MAX_AGE_S:
        return f"the relayed call's identity was signed {age:.0f} s ago"
    if not hmac.compare_digest(tag, _identity_mac(key, identity, method, session_id, stamp)):
        return "the relayed call's identity is not the one the fleet's ingress signed"
    return None


def relay_metadata(
    pairs: Sequence[tuple[str, str | bytes]],
    key: bytes | None = None,
    method: str = "",
    session_id: str = "",
) -> Metadata:
    """Caller metadata for the replica: credentials out, the caller's identity in, trace context
    replaced by the current span's.

    The caller's token never leaves the ingress; the replica learns whom the call is
    for from `fedge-identity`, which only its own relay may assert. The replica's
    server span nests under the ingress's span rather than beside it; with tracing off
    there is no current span and the caller's context passes on.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    dropped = PRIVATE_KEYS | (TRACE_KEYS if carrier else frozenset())
    kept = tuple((k, v) for k, v in clean_metadata(pairs) if k not in dropped)
    identity = caller_identity(pairs)
    signed = (
        ()
        if key is None
        else ((IDENTITY_SIG_KEY, sign_identity(key, identity, method, session_id)),)
    )
    return (*kept, (IDENTITY_KEY, identity), *signed, *carrier.items())


def failure_kind(error: BaseException) -> str:
    """GONE (the replica died or is stopping), BUSY (a full queue) or FAILED (anything else)."""
    from ray import exceptions as ray_errors
    from ray.serve import exceptions as serve_errors

    cause = getattr(error, "cause", None)
    if isinstance(error, serve_errors.BackPressureError):
        return BUSY
    gone = (ray_errors.RayActorError, ray_errors.ActorUnavailableError, ReplicaStopping)
    if isinstance(error, gone) or isinstance(cause, ReplicaStopping):
        return GONE
    return FAILED


def busy(what: str, retry_s: float = BUSY_RETRY_S) -> CallResult:
    """RESOURCE_EXHAUSTED with a retry-after."""
    wait_ms = str(math.ceil(retry_s * 1000))
    return CallResult(
        "RESOURCE_EXHAUSTED",
        f"{what}; retry after {wait_ms} ms",
        trailing=((RETRY_AFTER_KEY, wait_ms),),
    )


def failure_result(kind: str, session_id: str) -> CallResult:
    """The status a relay failure of `kind` ends a session's call with."""
    if kind == BUSY:
        return busy("the verifier replicas' queues are full")
    if kind == GONE:
        return CallResult(
            "NOT_FOUND",
            f"session {session_id!r} was lost with its replica; reopen it from the committed "
            "tokens",
        )
    return CallResult("UNAVAILABLE", "the relay to a verifier replica failed; retry the call")


class Admission:
    """At most `limit` calls held by the ingress at once; the next is refused, not queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0

    @contextlib.contextmanager
    def admit(self) -> Iterator[CallResult | None]:
        """Hold a slot for the call (None), or give the refusal to send when all are taken."""
        if self.held >= self.limit:
            self.refused += 1
            yield busy(f"the fleet ingress holds {self.limit} calls already")
            return
        self.held += 1
        try:
            yield None
        finally:
            self.held -= 1


def routing_tokens(request: Message) -> int:
    """Tokens a call puts through the target: its token-id lists (prompt, draft), a Generate budget."""
    tokens = 1
    for field_desc, value in request.ListFields():
        if field_desc.name == "max_new_tokens":
            tokens += int(value)
        elif field_desc.type in INT_TYPES and not isinstance(value, int):  # repeated ids
            tokens += len(value)
    return tokens


def session_of(message: Message) -> str:
    """The message's session id, or "" when it has none."""
    return str(getattr(message, SESSION_FIELD, "") or "")


def session_key(owner: str, session_id: str) -> str:
    """An opaque key of the owner's session for the routers to count sessions by ("" for none).

    Ids are scoped by owner (two devices may pick the same id), and neither the id, which
    reaches a session, nor the owner's identity travels into Ray's request metadata.
    """
    if not session_id:
        return ""
    return hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()[:SESSION_KEY_CHARS]
