"""Client-side strategy state stores: in the node's Context (memory) or on disk, versioned by round.

A store keeps one array dict per round that produced it and ``load(r)`` returns the
newest one from a round before ``r``. Replaying round ``r`` after a crash therefore
sees exactly the state it saw the first time, which makes resume exact.
:class:`CommittedStore` narrows that to rounds whose contribution the server accepted,
so a rejected, late or SecAgg-dropped reply never advances the client's state.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedge.strategies.arrays import array_numpy
from fedge.strategies.contract import ClientStateStore
from fedge.types import Arrays

_ROUND_FILE = re.compile(r"^round_(\d+)\.npz$")
_PREFIX = "fedge.client-state.round-"


class MemoryStore:
    """State kept in a plain dict (tests and single-process use)."""

    def __init__(self) -> None:
        self._by_round: dict[int, Arrays] = {}

    def load(self, server_round: int) -> Arrays | None:
        """Return the newest state from a round before ``server_round``."""
        earlier = [r for r in self._by_round if r < server_round]
        return dict(self._by_round[max(earlier)]) if earlier else None

    def save(self, server_round: int, arrays: Arrays) -> None:
        """Keep the state produced by ``server_round``."""
        self._by_round[server_round] = {k: np.array(v, copy=True) for k, v in arrays.items()}

    def forget_before(self, server_round: int) -> None:
        """Drop states older than the newest one from a round <= ``server_round``."""
        for old in _superseded(list(self._by_round), server_round):
            del self._by_round[old]


class ContextStore:
    """State kept in a Flower ``Context.state`` RecordDict (lives as long as the node)."""

    def __init__(self, state: RecordDict) -> None:
        self._state = state

    def _rounds(self) -> list[int]:
        return sorted(
            int(k[len(_PREFIX) :]) for k in self._state.array_records if k.startswith(_PREFIX)
        )

    def load(self, server_round: int) -> Arrays | None:
        """Return the newest state from a round before ``server_round``."""
        earlier = [r for r in self._rounds() if r < server_round]
        if not earlier:
            return None
        rec = self._state.array_records[f"{_PREFIX}{max(earlier)}"]
        return {k: array_numpy(v) for k, v in rec.items()}

    def save(self, server_round: int, arrays: Arrays) -> None:
        """Record the state of ``server_round``."""
        self._state[f"{_PREFIX}{server_round}"] = ArrayRecord(
            {k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}
        )

    def forget_before(self, server_round: int) -> None:
        """Drop states older than the newest one from a round <= ``server_round``."""
        for old in _superseded(self._rounds(), server_round):
            del self._state[f"{_PREFIX}{old}"]


class DiskStore:
    """State in ``<root>/round_<r>.npz`` files: survives a killed simulation (exact resume)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def load(self, server_round: int) -> Arrays | None:
        """Return the newest state from a round before ``server_round``."""
        if not self.root.is_dir():
            return None
        rounds = [int(m.group(1)) for p in self.root.iterdir() if (m := _ROUND_FILE.match(p.name))]
        earlier = [r for r in rounds if r < server_round]
        if not earlier:
            return None
        with np.load(self.root / f"round_{max(earlier)}.npz") as data:
            return {k: data[k] for k in data.files}

    def save(self, server_round: int, arrays: Arrays) -> None:
        """Write the state of ``server_round`` atomically (temp file, then rename)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".round_{server_round}.tmp.npz"
        np.savez(tmp, **arrays)  # type: ignore[arg-type]
        tmp.replace(self.root / f"round_{server_round}.npz")

    def forget_before(self, server_round: int) -> None:
        """Delete state files older than the newest one from a round <= ``server_round``."""
        if not self.root.is_dir():
            return
        rounds = [int(m.group(1)) for p in self.root.iterdir() if (m := _ROUND_FILE.match(p.name))]
        for old in _superseded(rounds, server_round):
            (self.root / f"round_{old}.npz").unlink(missing_ok=True)


class CommittedStore:
    """A store seen through the server's acceptances: only committed rounds are ever loaded.

    ``committed`` is the last round whose contribution from this client the server
    accepted (0: none). States saved by later rounds stay pending: they are used once
    the server reports their round accepted, and superseded states are forgotten.
    """

    def __init__(self, inner: ClientStateStore, committed: int) -> None:
        self.inner = inner
        self.committed = committed

    def load(self, server_round: int) -> Arrays | None:
        """The newest committed state from a round before ``server_round``."""
        return self.inner.load(min(server_round, self.committed + 1))

    def save(self, server_round: int, arrays: Arrays) -> None:
        """Keep ``server_round``'s state as pending and drop what the commit superseded."""
        self.inner.save(server_round, arrays)
        forget = getattr(self.inner, "forget_before", None)  # a user's store may keep all
        if forget is not None:
            forget(self.committed)


def _superseded(rounds: list[int], committed: int) -> list[int]:
    """Rounds older than the newest round <= ``committed`` (never that one, never pending ones)."""
    kept = [r for r in rounds if r <= committed]
    newest = max(kept) if kept else None
    return [r for r in rounds if newest is not None and r < newest]
