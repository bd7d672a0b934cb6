"""One metrics row per round, and the run's ``status.json``: what the loop reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedge import keys
from fedge.privacy.wire import MET_DP_TRAIN_LOSS
from fedge.server.aggregation import AggregateResult
from fedge.server.budget import PrivacyBudget
from fedge.server.privacy.plots import dpsgd_epsilon
from fedge.strategies.base import Strategy


def round_row(
    server_round: int,
    status: str,
    strategy: Strategy,
    loss: float = math.nan,
    part_loss: float = math.nan,
    client_loss: float = math.nan,
    sampled: int = 0,
    result: AggregateResult | None = None,
    seconds: float = 0.0,
    epsilon: float = 0.0,
    budget: PrivacyBudget | None = None,
    train_phase: float = 0.0,
    connected: int = 0,
) -> dict[str, Any]:
    """One metrics row (NaN becomes null in JSON)."""
    per_client = _per_client_metrics(result)
    counted = float(result.summed[keys.KEY_COUNT][0]) if result and result.summed else 0.0
    # under DP the clients send only the noised loss (``dp-train-loss``), never the clear one
    train_losses = [
        m[name]
        for m in per_client
        for name in (keys.MET_TRAIN_LOSS, MET_DP_TRAIN_LOSS)
        if name in m
    ]
    train_secs = [m.get(keys.MET_TRAIN_SECONDS, 0.0) for m in per_client]
    return {
        "round": server_round,
        "status": status,
        "strategy": strategy.name,
        "train_loss": _num(float(np.mean(train_losses)) if train_losses else math.nan),
        "eval_loss": _num(loss),
        "perplexity": _num(math.exp(loss) if math.isfinite(loss) else math.nan),
        "participants_eval_loss": _num(part_loss),
        "participants_perplexity": _num(
            math.exp(part_loss) if math.isfinite(part_loss) else math.nan
        ),
        "client_eval_loss": _num(client_loss),
        "clients_connected": connected,
        "clients_sampled": sampled,
        "partitions_trained": sorted(
            int(m[keys.MET_PARTITION]) for m in per_client if keys.MET_PARTITION in m
        ),
        "clients_succeeded": len(result.accepted) if result else 0,
        "clients_rejected": len(result.rejected) if result else 0,
        "clients_dropped": (len(result.accepted) - round(counted))
        if result and result.summed
        else 0,
        "bytes_up": result.bytes_up if result else 0,
        "bytes_down": result.bytes_down if result else 0,
        "round_seconds": round(seconds, 4),
        "train_phase_seconds": round(train_phase, 4),
        "train_seconds_max": round(max(train_secs), 4) if train_secs else 0.0,
        "train_seconds_sum": round(sum(train_secs), 4),
        "epsilon": epsilon,
        "epsilon_accountant": getattr(budget, "method", None),  # rdp | pld | None (no DP)
        "dp_sgd_epsilon": _num(dpsgd_epsilon(per_client)),
        "model_loads_max": max((m.get(keys.MET_MODEL_LOADS, 0.0) for m in per_client), default=0.0),
        "worker_calls_max": max((m.get(keys.MET_CALLS, 0.0) for m in per_client), default=0.0),
        "rejected": {str(n): why for n, why in sorted(result.rejected.items())} if result else {},
    }


def _per_client_metrics(result: AggregateResult | None) -> list[dict[str, float]]:
    """Each accepted client's metrics; under SecAgg+, where only their sum reached the server,
    every accepted client is given the mean (so means and sums are right, maxima are means)."""
    if result is None:
        return []
    if result.metrics or not result.summed_metrics or not result.accepted:
        return list(result.metrics.values())
    mean = {k: v / len(result.accepted) for k, v in result.summed_metrics.items()}
    return [mean] * len(result.accepted)


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def write_status(run_dir: Path, status: str, message: str) -> None:
    """Write ``status.json``: running, completed, budget or failed, and why."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"status": status, "message": message}) + "\n")
