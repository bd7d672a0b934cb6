"""Per-session KV caches of the verifier, bounded by time-to-live, LRU order and a memory cap."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from edge.verifier.errors import Overloaded, SessionNotFound


@dataclass
class Session:
    """One sequence on the verifier: KV of all committed tokens but the last (`pending`)."""

    session_id: str
    kv: torch.Tensor  # [1, 2 * layers, kv_heads, length - 1, head_dim], see edge._hf.stack_kv
    pending: int  # last committed token; its KV is computed by the next verify
    temperature: float
    generator: torch.Generator
    last_used: float
    busy: bool = False
    nbytes: int = field(default=0)

    @property
    def length(self) -> int:
        """Committed tokens: everything in the KV cache plus the pending token."""
        return int(self.kv.shape[3]) + 1


class SessionStore:
    """Holds sessions under three limits; evicts idle sessions least-recently-used first.

    Thread-safe: the gRPC threads open, look up and close; the engine's worker
    thread grows KV caches. A busy session (verify in flight) is never evicted.
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        cap_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.lock = threading.RLock()
        self._max_sessions = max_sessions
        self._ttl_s = ttl_s
        self._cap_bytes = cap_bytes
        self._clock = clock
        self._on_evict = on_evict or (lambda reason: None)
        self._total_bytes = 0

    def __len__(self) -> int:
        with self.lock:
            return len(self._sessions)

    @property
    def total_bytes(self) -> int:
        """KV bytes held by all sessions."""
        with self.lock:
            return self._total_bytes

    def add(self, session: Session) -> None:
        """Admit a session, making room by expiry and LRU eviction; Overloaded if impossible."""
        with self.lock:
            self.expire()
            while len(self._sessions) >= self._max_sessions:
                if not self._evict_one(keep=set()):
                    raise Overloaded(
                        f"all {self._max_sessions} sessions are busy; retry later or raise max_sessions"
                    )
            session.nbytes = _nbytes(session.kv)
            self.reserve(session.nbytes, keep=set())
            session.last_used = self._clock()
            self._sessions[session.session_id] = session
            self._total_bytes += session.nbytes

    def get(self, session_id: str) -> Session:
        """Look a session up and mark it most recently used; SessionNotFound if absent or expired."""
        with self.lock:
            self.expire()
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFound(
                    f"session {session_id!r} is unknown, closed, expired or evicted; open a new session"
                )
            session.last_used = self._clock()
            self._sessions.move_to_end(session_id)
            return session

    def remove(self, session_id: str) -> Session:
        """Drop a session and free its KV; SessionNotFound if absent."""
        with self.lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise SessionNotFound(
                    f"session {session_id!r} is unknown, closed, expired or evicted"
                )
            self._total_bytes -= session.nbytes
            return session

    def set_kv(self, session: Session, kv: torch.Tensor) -> None:
        """Replace a session's KV cache, keeping the byte count right."""
        with self.lock:
            nbytes = _nbytes(kv)
            if session.session_id in self._sessions:
                self._total_bytes += nbytes - session.nbytes
            session.kv = kv
            session.nbytes = nbytes

    def reserve(self, extra_bytes: int, keep: set[str]) -> None:
        """Evict idle LRU sessions (not in `keep`) until `extra_bytes` more fit under the cap."""
        with self.lock:
            while self._total_bytes + extra_bytes > self._cap_bytes:
                if not self._evict_one(keep):
                    raise Overloaded(
                        f"KV memory cap of {self._cap_bytes} bytes reached by sessions in use; "
                        "retry later or raise the cap"
                    )

    def expire(self) -> int:
        """Drop idle sessions older than the TTL; returns how many went."""
        with self.lock:
            deadline = self._clock() - self._ttl_s
            stale = [
                sid for sid, s in self._sessions.items() if s.last_used < deadline and not s.busy
            ]
            for sid in stale:
                self._total_bytes -= self._sessions.pop(sid).nbytes
                self._on_evict("ttl")
            return len(stale)

    def _evict_one(self, keep: set[str]) -> bool:
        """Evict the least recently used idle session not in `keep`; False when none qualifies."""
        for sid, session in self._sessions.items():
            if not session.busy and sid not in keep:
                self._total_bytes -= self._sessions.pop(sid).nbytes
                self._on_evict("lru")
                return True
        return False


def _nbytes(tensor: torch.Tensor) -> int:
    """Memory held by a tensor's elements, in bytes."""
    return tensor.numel() * tensor.element_size()
