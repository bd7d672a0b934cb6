"""This node's privacy ledger on its own disk: what its data has released, across runs and restarts.

The DP-SGD accountant history and the distributed-DP releases a node contributed to
live in one JSON file per partition (the node's data), written atomically after each
release. The key is the node's own (its state dir and ``partition-id``, both node
config), never the run id, which the server chooses: a new run continues the node's
epsilon instead of starting again at 0. The node's SecAgg+ identity key and identity
pins live beside it (:mod:`fedge.clients.secagg.mod`).

The state dir (:func:`ledger_root`), first that is set:

1. node config ``privacy-state-dir`` (a SuperNode's ``--node-config``): the deployer's choice;
2. ``FEDGE_PRIVACY_STATE_DIR`` (``fedge simulate`` sets it to ``<run>/privacy-state`` unless
   the user did);
3. ``privacy-state/`` beside the node's policy file (``privacy-policy`` node config or
   ``FEDGE_PRIVACY_POLICY``; ``fedge privacy init`` writes both);
4. ``$FEDGE_HOME/privacy-state/app-<12 hex>``, one per app: the hex is a digest of the names
   of the app's run-config keys (its ``[tool.flwr.app.config]``), so two apps never share a
   ledger or pins by accident, and runs of one app do. A server that ships another app gets
   another directory, so a node that must carry its epsilon across everything sets 1 or 3.
"""

from __future__ import annotations

import hashlib
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
_POLICY_KEY, _POLICY_ENV = "privacy-policy", "FEDGE_PRIVACY_POLICY"  # as in .policy (no cycle)
DPSGD = "dp-sgd"  # Opacus accountant history: noise-multipliers, sample-rates, steps
RELEASES = "user-level"  # noise multiplier of every distributed-DP round this node noised
MODELS = "trained-models"  # digests of the global models this node trained on (once-per-model)


def ledger_root(
    node_config: Mapping[str, object], run_config: Mapping[str, object] | None = None
) -> Path:
    """This node's state dir (see the module doc for the order)."""
    configured = str(node_config.get(NODE_STATE_DIR_KEY, "") or os.environ.get(STATE_DIR_ENV, ""))
    if configured:
        return Path(configured).expanduser()
    policy = str(node_config.get(_POLICY_KEY, "") or os.environ.get(_POLICY_ENV, ""))
    if policy:
        return Path(policy).expanduser().absolute().parent / "privacy-state"
    return fedge_home() / "privacy-state" / app_tag(run_config or {})


def app_tag(run_config: Mapping[str, object]) -> str:
    """``app-`` and 12 hex of the app's run-config key names (not values: one app, many runs)."""
    names = "\n".join(sorted(str(k) for k in run_config))
    return "app-" + hashlib.sha256(names.encode()).hexdigest()[:12]


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` durably: a temp file, fsynced, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


class ModelAlreadyUsed(ValueError):
    """This node already trained on the global model a message sends (once-per-model)."""


class Ledger:
    """One JSON document per partition; ``load`` then ``save`` around each release."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_node(
        cls,
        node_config: Mapping[str, object],
        partition: int,
        run_config: Mapping[str, object] | None = None,
    ) -> Ledger:
        """The ledger of ``partition`` under this node's state dir, for every run."""
        return cls(ledger_root(node_config, run_config) / f"partition-{partition:05d}.json")

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
        """Write atomically (temp file + fsync + rename): a crash leaves the old or the new one."""
        write_atomic(self.path, json.dumps(data, sort_keys=True))

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
    return Ledger.for_node(context.node_config, pid, context.run_config)
