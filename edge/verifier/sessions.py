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

SHARE_RETRY_S = 0.5  # retry-after of a refusal for a quota or fair share: sessions end slowly


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
    stream: bool = False  # a Generate stream's: busy for its life, preemptible above its share
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
    """Holds sessions under per-owner fair shares; evicts idle sessions least-recently-used first.

    Thread-safe: the gRPC threads open, look up and close; the engine's worker thread
    admits sessions and grows KV caches (every eviction happens there or in `expire`). A
    session with a verify in flight is never evicted. Two resources are shared, the
    session table (`max_sessions`) and the KV memory (`cap_bytes`), each max-min fairly
    among the owners holding sessions (plus the one asking): the fair share of each is
    the capacity over that count. An owner (the caller's authenticated identity) also
    holds at most `owner_quota` sessions and `owner_kv_quota` KV bytes (0: no quota).

    When a new session or a growing cache of owner X needs room:

    - X within its fair share after the growth makes room first among the idle sessions
      of owners above their share (the one most above first, its least recently used
      first), then by preempting their Generate streams, then among its own idle sessions;
      never from an owner at or below its share;
    - X above its share makes room only among its own idle sessions, and may not take
      the free room the other owners still need to reach their share;
    - with no room to make, the call is refused Overloaded; nobody else's sessions go.
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        cap_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str], None] | None = None,
        owner_quota: int = 0,
        default_quota: int = 0,
        owner_kv_quota: int = 0,
        on_remove: Callable[[Session], None] | None = None,
    ) -> None:
        """`owner_quota` applies to every owner; `default_quota` (the quota nobody configured)
        only to identified owners: without authentication every caller is owner "".
        `owner_kv_quota`: KV bytes any one owner may hold (0: its fair share only)."""
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.lock = threading.RLock()
        self._owner_quota = owner_quota
        self._default_quota = default_quota
        self._owner_kv_quota = owner_kv_quota
        self._max_sessions = max_sessions
        self._ttl_s = ttl_s
        self._cap_bytes = cap_bytes
        self._clock = clock
        self._on_evict = on_evict or (lambda reason: None)
        self._on_remove = on_remove or (lambda session: None)  # frees KV held elsewhere
        self._total_bytes = 0
        self._bytes: dict[str, int] = {}  # owner -> KV bytes of its sessions
        self._count: dict[str, int] = {}  # owner -> its sessions (owners holding none absent)

    def __len__(self) -> int:
        with self.lock:
            return len(self._sessions)

    @property
    def total_bytes(self) -> int:
        """KV bytes held by all sessions."""
        with self.lock:
            return self._total_bytes

    def quota_of(self, owner: str) -> int:
        """The most sessions `owner` may hold (0: no quota beyond its fair share)."""
        return self._owner_quota or (self._default_quota if owner else 0)

    def add(self, session: Session) -> None:
        """Admit a session, making room by expiry and fair eviction; Overloaded if impossible."""
        with self.lock:
            self.expire()
            if session.key in self._sessions:
                raise SessionBusy(
                    f"session {session.session_id!r} is already open (a retry racing its first "
                    "attempt?); retry the verify without committed_ids"
                )
            self.make_slot(session.owner)
            session.nbytes = _hf.cache_nbytes(session.cache)
            self.reserve(session.nbytes, set(), session.owner)
            session.last_used = self._clock()
            self._sessions[session.key] = session
            self._charge(session.owner, session.nbytes, 1)

    def make_slot(self, owner: str) -> None:
        """Make room in the table for one more session of `owner` (before its prefill runs)."""
        with self.lock:
            quota = self.quota_of(owner)
            while quota and self._count.get(owner, 0) >= quota:
                if not self._evict_own(owner, set(), "quota"):
                    raise Overloaded(
                        f"this device's {quota} sessions are all busy (per-device quota); close "
                        "some or retry later",
                        SHARE_RETRY_S,
                    )
            self._make_room(
                owner,
                1,
                set(),
                self._count,
                self._max_sessions,
                lambda _: len(self._sessions),
                "session table",
                "lru",
            )

    def active_since(self, since: float) -> int:
        """Sessions busy or used at or after `since` (clock time): streams likely to verify soon."""
        with self.lock:
            return sum(1 for s in self._sessions.values() if s.busy or s.last_used >= since)

    def owned_by(self, owner: str) -> int:
        """Sessions held by `owner`."""
        with self.lock:
            return self._count.get(owner, 0)

    def bytes_of(self, owner: str) -> int:
        """KV bytes held by `owner`'s sessions."""
        with self.lock:
            return self._bytes.get(owner, 0)

    def holds(self, session: Session) -> bool:
        """Whether `session` itself is still in the store (not closed, expired or evicted)."""
        with self.lock:
            return self._sessions.get(session.key) is session

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
            self._charge(session.owner, -session.nbytes, -1)
            self._on_remove(session)
            return session

    def drop_where(self, doomed: Callable[[Session], bool]) -> int:
        """Drop every session `doomed` picks (busy or not: its KV is gone); returns how many."""
        with self.lock:
            keys = [key for key, s in self._sessions.items() if doomed(s)]
            for key in keys:
                session = self._sessions.pop(key)
                self._charge(session.owner, -session.nbytes, -1)
                self._on_remove(session)
            return len(keys)

    def resized(self, session: Session) -> None:
        """Recount a session's KV bytes after its cache grew or shrank."""
        nbytes = _hf.cache_nbytes(session.cache)
        with self.lock:
            if self._sessions.get(session.key) is session:
                self._charge(session.owner, nbytes - session.nbytes, 0)
            session.nbytes = nbytes

    def reserve(
        self, extra_bytes: int, keep: set[str], owners: str | set[str], hold: bool = False
    ) -> None:
        """Make room for `extra_bytes` more KV of one owner (sessions in `keep` stay).

        `owners` names that owner (a one-element set is accepted for older callers). With
        `hold` the bytes stay counted to it until `release`: a batch holds each owner's growth
        while it reserves the next owner's."""
        owner = owners if isinstance(owners, str) else _single(owners)
        with self.lock:
            quota = self._owner_kv_quota
            while quota and self._bytes.get(owner, 0) + extra_bytes > quota:
                if not self._evict_own(owner, keep, "quota"):
                    raise Overloaded(
                        f"this device's KV quota of {quota} bytes is held by its sessions in use "
                        f"({self._bytes.get(owner, 0)} bytes) and {extra_bytes} more were asked; "
                        "close some or retry later",
                        SHARE_RETRY_S,
                    )
            self._make_room(
                owner,
                extra_bytes,
                keep,
                self._bytes,
                self._cap_bytes,
                lambda _: self._total_bytes,
                "KV memory",
                "lru",
            )
            if hold:
                self._bytes[owner] = self._bytes.get(owner, 0) + extra_bytes
                self._total_bytes += extra_bytes

    def release(self, owner: str, nbytes: int) -> None:
        """Stop counting bytes a `reserve(..., hold=True)` held (the caches now hold them)."""
        with self.lock:
            self._total_bytes -= nbytes
            if owner in self._bytes:
                self._bytes[owner] -= nbytes

    def expire(self) -> int:
        """Drop idle sessions older than the TTL; returns how many went."""
        with self.lock:
            deadline = self._clock() - self._ttl_s
            stale = [
                sid for sid, s in self._sessions.items() if s.last_used < deadline and not s.busy
            ]
            for sid in stale:
                self._drop(sid, "ttl")
            return len(stale)

    # ------------------------------------------------------------------ fair shares
    def _charge(self, owner: str, nbytes: int, count: int) -> None:
        """Account `nbytes` and `count` sessions more (or less) to `owner`."""
        self._total_bytes += nbytes
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        self._count[owner] = self._count.get(owner, 0) + count
        if self._count[owner] <= 0:
            del self._count[owner]
            self._bytes.pop(owner, None)

    def _drop(self, key: str, reason: str) -> None:
        """Evict the session stored under `key`."""
        session = self._sessions.pop(key)
        self._charge(session.owner, -session.nbytes, -1)
        self._on_remove(session)
        self._on_evict(reason)

    def _make_room(
        self,
        owner: str,
        need: int,
        keep: set[str],
        usage: dict[str, int],
        capacity: int,
        used: Callable[[dict[str, int]], int],
        what: str,
        reason: str,
    ) -> None:
        """Evict until `need` more of one resource fit for `owner` by the rules of the class."""
        while True:
            owners = set(usage) | {owner}
            share = capacity / len(owners)
            mine = usage.get(owner, 0)
            within = mine + need <= share
            limit = capacity
            if not within:  # the room the others still need to reach their share stays free
                limit -= int(sum(max(0.0, share - usage.get(o, 0)) for o in owners - {owner}))
            if used(usage) + need <= limit:
                return
            unit = "bytes" if usage is self._bytes else "sessions"
            if within and self._evict_over_share(owner, share, usage, keep):
                continue
            if self._evict_own(owner, keep, reason):
                continue
            raise Overloaded(
                f"{what} cap of {capacity} {unit} reached: this device holds {mine}, its fair share "
                f"among the {len(owners)} devices holding sessions is {int(share)}, and it has no "
                "idle session to give up; retry later"
                + (" or raise the cap" if len(owners) == 1 else ""),
                SHARE_RETRY_S,
            )

    def _evict_over_share(
        self, owner: str, share: float, usage: dict[str, int], keep: set[str]
    ) -> bool:
        """Evict one session of the owner most above its share: its LRU idle one, else a stream."""
        over = sorted(
            (o for o, held in usage.items() if o != owner and held > share),
            key=lambda o: usage[o],
            reverse=True,
        )
        for victim in over:
            for preempt in (False, True):
                for key, session in self._sessions.items():
                    if session.owner != victim or key in keep:
                        continue
                    if (not session.busy) if not preempt else (session.busy and session.stream):
                        self._drop(key, "share" if not preempt else "preempt")
                        return True
        return False

    def _evict_own(self, owner: str, keep: set[str], reason: str) -> bool:
        """Evict the least recently used idle session of `owner` not in `keep`."""
        for key, session in self._sessions.items():
            if session.busy or key in keep or session.owner != owner:
                continue
            self._drop(key, reason)
            return True
        return False


def _single(owners: set[str]) -> str:
    """The one owner of a reservation."""
    if len(owners) != 1:
        raise ValueError(f"a reservation is for one owner, got {sorted(owners)}")
    return next(iter(owners))
