"""How long the server worked on a call, told to the caller so that it can time the network alone.

The verifier (and the fleet's ingress in front of it) sends `fedge-server-ms`: the
milliseconds from the call's arrival to its reply, in a unary call's trailing metadata and
in a stream's initial metadata, sent just before its first reply (for a Generate that span
holds the prompt's prefill). The edge subtracts it from the exchange it timed, so its
round-trip estimate is the network's, not the network's plus the verifier's compute. A
server that sends no such key leaves the caller's timing as it was.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

SERVER_MS_KEY = "fedge-server-ms"


def server_ms_metadata(started: float) -> tuple[tuple[str, str], ...]:
    """The metadata saying the server worked since `started` (a `time.perf_counter()` value)."""
    return ((SERVER_MS_KEY, f"{max(0.0, (time.perf_counter() - started) * 1e3):.3f}"),)


def server_seconds(*metadata: Sequence[tuple[str, Any]] | None) -> float | None:
    """The server's time in seconds from the first of `metadata` that carries it (None: none did,
    or its value was not a finite number >= 0)."""
    for pairs in metadata:
        for key, value in pairs or ():
            if key != SERVER_MS_KEY:
                continue
            try:
                ms = float(value.decode() if isinstance(value, bytes) else value)
            except ValueError:
                return None
            return ms / 1e3 if math.isfinite(ms) and ms >= 0 else None
    return None
