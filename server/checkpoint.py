"""Per-round checkpoints: global adapter, strategy state, round number, sampler RNG and budget state.

Layout: ``<run>/checkpoints/round_0003/{state.npz, meta.json}``, written to a temp
directory and renamed, so a kill never leaves a half checkpoint that looks whole.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strategies.base import GlobalState

_ROUND_DIR = re.compile(r"^round_(\d{4,})$")
_ADAPTER, _EXTRAS = "adapter::", "extras::"


@dataclass(frozen=True)
class Checkpoint:
    """What a resumed run restores."""

    state: GlobalState
    rng_state: dict[str, Any]
    budget_state: dict[str, float]
    strategy: str


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
    )
