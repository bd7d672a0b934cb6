"""Client-side strategy state stores (they live in :mod:`fedge.strategies.state`, beside the hooks).

Re-exported here so the ClientApp and its tests keep their import path.
"""

from __future__ import annotations

from fedge.strategies.state import CommittedStore, ContextStore, DiskStore, MemoryStore

__all__ = ["CommittedStore", "ContextStore", "DiskStore", "MemoryStore"]
