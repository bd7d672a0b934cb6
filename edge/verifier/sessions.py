"""Per-session KV caches of the verifier, bounded by time-to-live, LRU order and a memory cap."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.edge import _hf
from fedge.edge.verifier.errors import Overloaded, SessionBusy, SessionNotFound
from fedge.edge.verifier.requests import VerifyResult, position_seed


def session_key(owner: str, session_id: str) -> str:
    """Store key of a session: ids are scoped by owner (bearer token), so tokens never collide."""
    return f"{owner}/{session_id}"


@dataclass(frozen=True)
class Replay:
    """The last verify applied to a session, kept so that its retry gets the same reply."""

    start_length: int  # session length before that verify
    draft_ids: tuple[int, ...]
    result: VerifyResult


@dataclass
class Session:
    """One sequence on the verifier: KV of all committed tokens but the last (`pending`).

    The KV lives in the model's own cache object, grown in place by a lone session's
    forward pass and cropped on rejection; a batched pass copies it into a padded batch.
    """

    session_id: str
    cache: Any  # length - 1 positions: a DynamicCache, or a ShardedKV the ring workers hold
    pending: int  # last committed token; its KV is computed by the next verify
    temperature: float
    seed: int  # its random draws at each position derive from this (see `draws`)
    last_used: float
    owner: str = ""  # digest of the bearer token that opened it ("" without auth)
    busy: bool = False
    nbytes: int = field(default=0)
    last: Replay | None = None

    @property
    def length(self) -> int:
        """Committed tokens: everything in the KV cache plus the pending token."""
        return _hf.cache_length(self.cache) + 1

    def draws(self, position: int) -> torch.Generator:
        """The generator of this session's random draws at `position` (its length then)."""
        return torch.Generator().manual_seed(position_seed(self.seed, position))

    @property
    def key(self) -> str:
        """The store key (owner-scoped id)."""
        return session_key(self.owner, self.session_id)


class SessionStore:
    """Holds sessions under three limits; evicts idle sessions least-recently-used first.

    Thread-safe: the gRPC threads open, look up and close; the engine's worker
    thread grows KV caches. A busy session (verify in flight) is never evicted. An
    owner (the caller's authenticated identity) holds at most `owner_quota` sessions.
    Whatever limit a new session or a growing cache meets (the quota, the session
    count, the memory cap), it makes room only among its own owner's idle sessions,
    least recently used first, never another owner's: when its owner has none to give
    up, the call is refused Overloaded and the other owners' sessions stay.
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        cap_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str], None] | None = None,
        owner_quota: int = 0,
        on_remove: Callable[[Session], None] | None = None,
    ) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.lock = threading.RLock()
        self._owner_quota = owner_quota or max_sessions
        self._max_sessions = max_sessions
        self._ttl_s = ttl_s
        self._cap_bytes = cap_bytes
        self._clock = clock
        self._on_evict = on_evict or (lambda reason: None)
        self._on_remove = on_remove or (lambda session: None)  # frees KV held elsewhere
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
            if session.key in self._sessions:
                raise SessionBusy(
                    f"session {session.session_id!r} is already open (a retry racing its first "
                    "attempt?); retry the verify without committed_ids"
                )
            owners = {session.owner}
            while self.owned_by(session.owner) >= self._owner_quota:
                if not self._evict_one(set(), owners, "quota"):
                    raise Overloaded(
                        f"this device's {self._owner_quota} sessions are all busy (per-device "
                        "quota); close some or retry later"
                    )
            while len(self._sessions) >= self._max_sessions:
                if not self._evict_one(set(), owners, "lru"):
                    raise Overloaded(
                        f"all {self._max_sessions} sessions are held, none idle of this device's "
                        "own; retry later or raise max_sessions"
                    )
            session.nbytes = _hf.cache_nbytes(session.cache)
            self.reserve(session.nbytes, set(), owners)
            session.last_used = self._clock()
            self._sessions[session.key] = session
            self._total_bytes += session.nbytes

    def active_since(self, since: float) -> int:
        """Sessions busy or used at or after `since` (clock time): streams likely to verify soon."""
        with self.lock:
            return sum(1 for s in self._sessions.values() if s.busy or s.last_used >= since)

    def owned_by(self, owner: str) -> int:
        """Sessions held by `owner`."""
        with self.lock:
            return sum(1 for s in self._sessions.values() if s.owner == owner)

    def get(self, session_id: str, owner: str = "") -> Session:
        """Look a session up and mark it most recently used; SessionNotFound if absent or expired."""
        key = session_key(owner, session_id)
        with self.lock:
            self.expire()
            session = self._sessions.get(key)
            if session is None:
                raise SessionNotFound(
                    f"session {session_id!r} is unknown, closed, expired or evicted; reopen it "
                    "by resending the verify with committed_ids"
                )
            session.last_used = self._clock()
            self._sessions.move_to_end(key)
            return session

    def remove(self, session_id: str, owner: str = "") -> Session:
        """Drop a session and free its KV; SessionNotFound if absent."""
        with self.lock:
            session = self._sessions.pop(session_key(owner, session_id), None)
            if session is None:
                raise SessionNotFound(
                    f"session {session_id!r} is unknown, closed, expired or evicted"
                )
            self._total_bytes -= session.nbytes
            self._on_remove(session)
            return session

    def drop_where(self, doomed: Callable[[Session], bool]) -> int:
        """Drop every session `doomed` picks (busy or not: its KV is gone); returns how many."""
        with self.lock:
            keys = [key for key, s in self._sessions.items() if doomed(s)]
            for key in keys:
                session = self._sessions.pop(key)
                self._total_bytes -= session.nbytes
                self._on_remove(session)
            return len(keys)

    def resized(self, session: Session) -> None:
        """Recount a session's KV bytes after its cache grew or shrank."""
        nbytes = _hf.cache_nbytes(session.cache)
        with self.lock:
            if self._sessions.get(session.key) is session:
                self._total_bytes += nbytes - session.nbytes
            session.nbytes = nbytes

    def reserve(self, extra_bytes: int, keep: set[str], owners: set[str]) -> None:
        """Evict idle LRU sessions of `owners` (not in `keep`) until `extra_bytes` more fit."""
        with self.lock:
            while self._total_bytes + extra_bytes > self._cap_bytes:
                if not self._evict_one(keep, owners, "lru"):
                    raise Overloaded(
                        f"KV memory cap of {self._cap_bytes} bytes reached by sessions in use or "
                        "of other devices; retry later or raise the cap"
                    )

    def expire(self) -> int:
        """Drop idle sessions older than the TTL; returns how many went."""
        with self.lock:
            deadline = self._clock() - self._ttl_s
            stale = [
                sid for sid, s in self._sessions.items() if s.last_used < deadline and not s.busy
            ]
            for sid in stale:
                session = self._sessions.pop(sid)
                self._total_bytes -= session.nbytes
                self._on_remove(session)
                self._on_evict("ttl")
            return len(stale)

    def _evict_one(self, keep: set[str], owners: set[str], reason: str) -> bool:
        """Evict the least recently used idle session of `owners` not in `keep`."""
        for sid, session in self._sessions.items():
            if session.busy or sid in keep or session.owner not in owners:
                continue
            self._total_bytes -= self._sessions.pop(sid).nbytes
            self._on_remove(session)
            self._on_evict(reason)
            return True
        return False
