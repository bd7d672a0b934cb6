"""Identity pins on the node's disk, beside its ledger: node id -> Ed25519 key, first seen, for good.

Pins kept in a run's ``Context.state`` end with the run, and a new run reopened the
substitution they stop (a server relaying its own identity for a known node id). Here
they live in one JSON file per partition under the node's state dir
(:func:`fedge.clients.privacy.ledger.ledger_root`), written durably when a pin is added,
and read for every collect stage that names a node not pinned in memory yet.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedge.clients.privacy.ledger import write_atomic


class PinStore:
    """One node's identity pins in ``path`` ({} before the first)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[int, bytes]:
        """Node id -> identity key; an unreadable file is an error (never an empty set of pins)."""
        if not self.path.is_file():
            return {}
        try:
            raw = json.loads(self.path.read_text())
            return {int(u): bytes.fromhex(str(k)) for u, k in dict(raw).items()}
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(
                f"SecAgg+ identity pins {self.path} are unreadable ({exc}); restore the file or "
                "delete it knowingly (every neighbour is then trusted on first use again)"
            ) from exc

    def save(self, pins: dict[int, bytes]) -> None:
        """Write every pin (sorted), durably."""
        write_atomic(self.path, json.dumps({str(u): pins[u].hex() for u in sorted(pins)}))
