"""This node's privacy ledger on its own disk: what its data has released, across runs and restarts.

The DP-SGD accountant history and the distributed-DP releases a node contributed to
live in one JSON file per partition (the node's data), written atomically after each
release. The key is the node's own (its state root and ``partition-id``, both node
config), never the run id, which the server chooses: a new run continues the node's
epsilon instead of starting again at 0. Directory: node config ``privacy-state-dir``,
else ``FEDGE_PRIVACY_STATE_DIR``, else ``$FEDGE_HOME/privacy-ledger``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context

from fedge import keys
from fedge.paths import fedge_home

NODE_STATE_DIR_KEY = "privacy-state-dir"
STATE_DIR_ENV = "FEDGE_PRIVACY_STATE_DIR"
DPSGD = "dp-sgd"  # Opacus accountant history: noise-multipliers, sample-rates, steps
RELEASES = "user-level"  # noise multiplier of every distributed-DP round this node noised
MODELS = "trained-models"  # digests of the global models this node trained on (once-per-model)


def ledger_root(node_config: Mapping[str, object]) -> Path:
    """Where this node keeps its ledgers."""
    configured = str(node_config.get(NODE_STATE_DIR_KEY, "") or os.environ.get(STATE_DIR_ENV, ""))
    return Path(configured).expanduser() if configured else fedge_home() / "privacy-ledger"


class ModelAlreadyUsed(ValueError):
    """This node already trained on the global model a message sends (once-per-model)."""


class Ledger:
    """One JSON document per partition; ``load`` then ``save`` around each release."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_node(cls, node_config: Mapping[str, object], partition: int) -> Ledger:
        """The ledger of ``partition`` under this node's ledger directory, for every run."""
        return cls(ledger_root(node_config) / f"partition-{partition:05d}.json")

    def load(self) -> dict[str, Any]:
        """The ledger's content ({} before the first release); a corrupt file is an error."""
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"privacy ledger {self.path} is unreadable ({exc}); this node cannot know what it "
                "already spent, so it refuses to train: restore the file or delete it knowingly"
            ) from exc
        if not isinstance(data, dict):
            raise ValueError(f"privacy ledger {self.path} does not hold a JSON object")
        return data

    def save(self, data: Mapping[str, Any]) -> None:
        """Write atomically (temp file + rename), so a crash leaves the old or the new ledger."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, self.path)

    def releases(self) -> list[float]:
        """Noise multipliers of the user-level releases recorded so far (each finite, > 0)."""
        out = [float(z) for z in self.load().get(RELEASES, [])]
        if not all(math.isfinite(z) and z > 0 for z in out):
            raise ValueError(
                f"privacy ledger {self.path} holds a release whose noise multiplier is not a "
                "finite positive number; its epsilon is unknown, so this node refuses to train"
            )
        return out

    def record_release(self, noise_multiplier: float) -> None:
        """Append one user-level release; a non-finite or non-positive one is refused."""
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(
                "a release's noise multiplier must be finite and > 0 (rule: the ledger records "
                "only releases whose epsilon is known); nothing is released"
            )
        data = self.load()
        data[RELEASES] = [*data.get(RELEASES, []), float(noise_multiplier)]
        self.save(data)

    def claim_model(self, digest: str) -> None:
        """Record that this node trains on global model ``digest``; refuse a second time."""
        data = self.load()
        seen = list(data.get(MODELS, []))
        if digest in seen:
            raise ModelAlreadyUsed(
                "this node already trained on this global model (rule: once-per-model; two "
                "sums over one model whose cohorts differ by one client would reveal it)"
            )
        data[MODELS] = [*seen, digest]
        self.save(data)


def node_ledger(context: Context) -> Ledger:
    """The ledger of this node's data (keyed by partition, else by node id), spanning runs."""
    pid = int(str(context.node_config.get(keys.NODE_PARTITION_ID, context.node_id)))
    return Ledger.for_node(context.node_config, pid)
