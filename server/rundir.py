"""The run directory: resolved config, per-round metrics (JSON lines + CSV) and PNG plots.

::

    <run>/config.toml        the resolved configuration (flat keys; `fedge simulate --resume` reads it)
    <run>/metrics.jsonl      one JSON object per round (round 0 = before training)
    <run>/metrics.csv        the same rows as CSV
    <run>/perplexity.png     held-out perplexity per round
    <run>/checkpoints/       one folder per round (fedge.server.checkpoint)
    <run>/final/adapter/     peft adapter (PeftModel.from_pretrained)
    <run>/final/merged/      base + adapter merged, with the tokenizer, for serving
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRIC_COLUMNS = (
    "round",
    "status",
    "strategy",
    "train_loss",
    "eval_loss",
    "perplexity",
    "client_eval_loss",
    "clients_sampled",
    "clients_succeeded",
    "clients_rejected",
    "clients_dropped",
    "bytes_up",
    "bytes_down",
    "round_seconds",
    "train_phase_seconds",
    "train_seconds_max",
    "train_seconds_sum",
    "epsilon",
    "model_loads_max",
    "worker_calls_max",
)


def write_config(run_dir: Path, mapping: Mapping[str, Any]) -> Path:
    """Write the resolved flat config as TOML (one key = value per line)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.toml"
    lines = ["# resolved fedge federation config (flat keys, as in [tool.flwr.app.config])"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in mapping.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_config(run_dir: Path) -> dict[str, Any]:
    """Read a run directory's resolved config back."""
    import tomllib

    path = run_dir / "config.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a fedge run directory?")
    return tomllib.loads(path.read_text())


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


class MetricsLog:
    """Appends round rows to metrics.jsonl and rewrites metrics.csv from it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"

    def rows(self) -> list[dict[str, Any]]:
        """All rows written so far."""
        if not self.jsonl.is_file():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]

    def truncate_after(self, server_round: int) -> None:
        """Drop rows past a round (a resumed run redoes them)."""
        kept = [r for r in self.rows() if int(r["round"]) <= server_round]
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._write_csv(kept)

    def append(self, row: Mapping[str, Any]) -> None:
        """Add one round's row to both files."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.jsonl.open("a") as fh:
            fh.write(json.dumps(dict(row)) + "\n")
        self._write_csv(self.rows())

    def _write_csv(self, rows: Sequence[Mapping[str, Any]]) -> None:
        with self.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(METRIC_COLUMNS), extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: row.get(k, "") for k in METRIC_COLUMNS})


def plot_perplexity(series: Mapping[str, Sequence[Mapping[str, Any]]], out: Path) -> Path:
    """Plot held-out perplexity per round, one line per label (e.g. per strategy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in series.items():
        pts = [
            (int(r["round"]), float(r["perplexity"]))
            for r in rows
            if r.get("status") == "ok"
            and r.get("perplexity") is not None
            and math.isfinite(float(r["perplexity"]))
        ]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("Global adapter on the union of clients' held-out splits")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
