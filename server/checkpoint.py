"""Per-round checkpoints: global adapter, strategy state, round, sampler RNG, budget and roster.

The roster part (partitions seen so far, the participants scored) makes a resume under
churn exact: the nodes connected at the restart are not the ones connected before it.

Layout: ``<run>/checkpoints/round_0003/{state.npz, meta.json}``, written to a temp
directory and renamed, so a kill never leaves a half checkpoint that looks whole.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedge import keys
from fedge.strategies.base import GlobalState

if TYPE_CHECKING:
    from fedge.server.config import RunConfig
    from fedge.strategies.base import Strategy

_ROUND_DIR = re.compile(r"^round_(\d{4,})$")
_ADAPTER, _EXTRAS = "adapter::", "extras::"


@dataclass(frozen=True)
class Checkpoint:
    """What a resumed run restores."""

    state: GlobalState
    rng_state: dict[str, Any]
    budget_state: dict[str, float]
    strategy: str
    run_id: str = ""  # the fresh run this checkpoint belongs to
    config: dict[str, Any] = field(default_factory=dict)  # the run config it was made with
    committed: dict[int, int] = field(default_factory=dict)  # partition -> last accepted round
    seen: list[int] = field(default_factory=list)  # partitions seen so far (N without a known size)
    participants: list[int] = field(default_factory=list)  # whose held-out text scores the run


# Keys a resumed run may change: they steer the run or inject drills, not what it computes.
RESUMABLE_CHANGES = frozenset(
    {
        "num-server-rounds",
        "run-dir",
        "round-timeout",
        "client-threads",
        "client-eval",
        "save-merged",
        "plots",
        "tensorboard",
        "mlflow",
        "x-fault-partitions",  # fault drills (clients/faults.py) change between attempts
    }
)
RUN_OUTPUTS = (
    "checkpoints",
    "final",
    "metrics.jsonl",
    "metrics.csv",
    "status.json",
    "devices",
    "tensorboard",
)


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Describe every key (outside RESUMABLE_CHANGES) whose value differs between two configs."""
    names = sorted((saved.keys() | current.keys()) - RESUMABLE_CHANGES)
    return [
        f"{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
        for k in names
        if saved.get(k) != current.get(k)
    ]


def check_resumable(ckpt: Checkpoint, cfg: RunConfig, strategy: Strategy, run_dir: Path) -> None:
    """Refuse to resume a checkpoint made by another strategy or config, naming the difference."""
    saved = {k: v for k, v in ckpt.config.items() if k != keys.CFG_RUN_ID}
    current = {k: v for k, v in cfg.to_mapping().items() if k != keys.CFG_RUN_ID}
    differences = config_differences(saved, current) if saved else []
    if ckpt.strategy != strategy.name and not differences:
        differences = [
            f"strategy: checkpoint has {ckpt.strategy!r}, this run has {strategy.name!r}"
        ]
    if differences:
        raise ValueError(
            f"--resume refused: the checkpoint of round {ckpt.state.server_round} in {run_dir} "
            f"was made with another config ({'; '.join(differences)}). Resume with the same "
            "config, or start a new run in another directory"
        )


def archive_previous_run(run_dir: Path) -> Path | None:
    """Move an earlier run's outputs to ``<run>/previous/<time>/`` so a fresh run starts clean.

    Nothing is deleted: the earlier checkpoints, metrics and export stay readable there.
    """
    present = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not present:
        return None
    dest = run_dir / "previous" / datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
    dest.mkdir(parents=True)
    for path in present:
        path.replace(dest / path.name)
    return dest


def checkpoint_dir(run_dir: Path) -> Path:
    """The folder holding one sub-folder per checkpointed round."""
    return run_dir / "checkpoints"


def save_checkpoint(run_dir: Path, ckpt: Checkpoint) -> Path:
    """Write the checkpoint of ``ckpt.state.server_round`` atomically; return its folder."""
    root = checkpoint_dir(run_dir)
    final = root / f"round_{ckpt.state.server_round:04d}"
    tmp = root / f".tmp_round_{ckpt.state.server_round:04d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    arrays = {_ADAPTER + k: v for k, v in ckpt.state.adapter.items()}
    arrays.update({_EXTRAS + k: v for k, v in ckpt.state.extras.items()})
    np.savez(tmp / "state.npz", **arrays)  # type: ignore[arg-type]
    meta = {
        "server_round": ckpt.state.server_round,
        "rng_state": ckpt.rng_state,
        "budget_state": ckpt.budget_state,
        "strategy": ckpt.strategy,
        "run_id": ckpt.run_id,
        "config": ckpt.config,
        "committed": {str(p): r for p, r in sorted(ckpt.committed.items())},
        "seen": sorted(int(p) for p in ckpt.seen),
        "participants": [int(p) for p in ckpt.participants],
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)
    return final


def latest_round(run_dir: Path) -> int | None:
    """Return the newest complete checkpoint's round, or None."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    rounds = [int(m.group(1)) for p in root.iterdir() if (m := _ROUND_DIR.match(p.name))]
    return max(rounds) if rounds else None


def load_checkpoint(run_dir: Path, server_round: int | None = None) -> Checkpoint:
    """Load a round's checkpoint (default: the newest), or explain what is missing."""
    server_round = latest_round(run_dir) if server_round is None else server_round
    if server_round is None:
        raise FileNotFoundError(
            f"{checkpoint_dir(run_dir)} holds no checkpoint; start a new run instead of --resume"
        )
    folder = checkpoint_dir(run_dir) / f"round_{server_round:04d}"
    meta = json.loads((folder / "meta.json").read_text())
    with np.load(folder / "state.npz") as data:
        adapter = {k[len(_ADAPTER) :]: data[k] for k in data.files if k.startswith(_ADAPTER)}
        extras = {k[len(_EXTRAS) :]: data[k] for k in data.files if k.startswith(_EXTRAS)}
    return Checkpoint(
        GlobalState(adapter, extras, int(meta["server_round"])),
        meta["rng_state"],
        {k: float(v) for k, v in meta["budget_state"].items()},
        str(meta["strategy"]),
        str(meta.get("run_id", "")),
        dict(meta.get("config", {})),
        {int(p): int(r) for p, r in meta.get("committed", {}).items()},
        [int(p) for p in meta.get("seen", [])],
        [int(p) for p in meta.get("participants", [])],
    )
