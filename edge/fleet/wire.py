"""What crosses Ray between the ingress and a replica: relayed replies and caller metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Metadata = tuple[tuple[str, str], ...]
SERVING = "serving"  # routing stat a replica reports: its verifier says SERVING
SPEEDS = "speeds"  # routing stat a replica reports: its seconds per work token per kind of call
ROUTE_PIN = "route_pin"  # kwarg: the call must run on this replica (unique id), or nowhere
ROUTE_TOKENS = "route_tokens"  # kwarg: tokens the call puts through the target


class ReplicaStopping(RuntimeError):
    """A call reached a replica that Serve is stopping; the ingress handles it as the replica's loss."""


@dataclass(frozen=True)
class CallResult:
    """One relayed reply (or streamed message): status code name, details, payload, replica.

    `trailing` carries a failure's trailing metadata (e.g. a rate limit's retry-after).
    """

    code: str
    details: str = ""
    payload: bytes = b""
    replica: str = ""
    trailing: Metadata = ()


def clean_metadata(pairs: Sequence[tuple[str, str | bytes]]) -> Metadata:
    """Caller metadata worth relaying (e.g. authorization): drop gRPC's own and binary keys."""
    return tuple(
        (key, value)
        for key, value in pairs
        if isinstance(value, str) and not key.startswith(("grpc-", ":")) and key != "user-agent"
    )
