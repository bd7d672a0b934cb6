"""Device reports of a run: per round and per device (JSONL/CSV), a summary, and PNG plots.

::

    <run>/devices/rounds.jsonl, rounds.csv   per round: simulated start/end, eligible, selected,
                                             trained, partial, dropouts by cause, compute and
                                             wasted device-seconds, bytes, perplexity, hours
    <run>/devices/per_device.csv             per device: tier, batch, excluded (memory),
                                             selected, trained, dropouts, wasted, bytes
    <run>/devices/summary.json               totals, time to the target perplexity, by tier
    <run>/devices/perplexity_hours.png       held-out perplexity against simulated hours
    <run>/devices/participation.png          rounds trained per device, by tier
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedge.simulations.devicesim.grid import COUNTERS, DeviceSim

HOUR = 3600.0


def round_rows(
    sim: DeviceSim, metrics: Sequence[Mapping[str, Any]], start_s: float
) -> list[dict[str, Any]]:
    """Round records joined with the loop's perplexity; hours counted from ``start_s``."""
    ppl = {int(m["round"]): m.get("perplexity") for m in metrics}
    rows = []
    for r in sim.state.rounds:
        row = r.row()
        row["hours"] = (r.end_s - start_s) / HOUR
        row["perplexity"] = ppl.get(r.round)
        rows.append(row)
    return rows


def hours_to_target(rows: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """Simulated hours until the held-out perplexity first reaches ``target`` (None: never)."""
    if target <= 0:
        return None
    for row in rows:
        p = row.get("perplexity")
        if isinstance(p, int | float) and math.isfinite(p) and p <= target:
            return float(row["hours"])
    return None


def summary(sim: DeviceSim, rows: Sequence[Mapping[str, Any]], target: float) -> dict[str, Any]:
    """Totals over the run, participation by tier, and the time to the target perplexity."""
    c = sim.state.counters
    compute = float(c["compute_s"].sum())
    trained = c["trained"]
    by_tier: dict[str, dict[str, float]] = {}
    for k, name in enumerate(sim.pop.tier_names):
        sel = sim.pop.tier == k
        by_tier[name] = {
            "devices": int(sel.sum()),
            "excluded_memory": int((sel & sim.excluded).sum()),
            "selected": float(c["selected"][sel].sum()),
            "trained": float(trained[sel].sum()),
            "dropped_offline": float(c["dropped_offline"][sel].sum()),
            "dropped_deadline": float(c["dropped_deadline"][sel].sum()),
            "dropped_late": float(c["dropped_late"][sel].sum()),
            "wasted_device_hours": float(c["wasted_s"][sel].sum() / HOUR),
        }
    participants = trained > 0
    return {
        "rounds": len(rows),
        "simulated_hours": float(rows[-1]["hours"]) if rows else 0.0,
        "target_perplexity": target or None,
        "hours_to_target": hours_to_target(rows, target),
        "final_perplexity": rows[-1].get("perplexity") if rows else None,
        "devices": len(sim.pop),
        "excluded_memory": int(sim.excluded.sum()),
        "smaller_batch_memory": int(((sim.batches > 0) & (sim.batches < sim.workload.batch)).sum()),
        "devices_trained": int(participants.sum()),
        "selected": float(c["selected"].sum()),
        "trained": float(trained.sum()),
        "partial": float(c["partial"].sum()),
        "dropped": {
            "offline": float(c["dropped_offline"].sum()),
            "deadline": float(c["dropped_deadline"].sum()),
            "late": float(c["dropped_late"].sum()),
            "memory": int(sim.excluded.sum()),
        },
        "compute_device_hours": compute / HOUR,
        "wasted_device_hours": float(c["wasted_s"].sum() / HOUR),
        "wasted_fraction": float(c["wasted_s"].sum() / compute) if compute else 0.0,
        "bytes_down": float(c["bytes_down"].sum()),
        "bytes_up": float(c["bytes_up"].sum()),
        "bytes_up_per_participant": float(c["bytes_up"][participants].mean())
        if participants.any()
        else 0.0,
        "by_tier": by_tier,
    }


def write_reports(
    sim: DeviceSim,
    run_dir: Path,
    metrics: Sequence[Mapping[str, Any]],
    start_s: float,
    target: float,
) -> dict[str, Any]:
    """Write every device report of a run into ``<run>/devices``; return the summary."""
    out = run_dir / "devices"
    out.mkdir(parents=True, exist_ok=True)
    rows = round_rows(sim, metrics, start_s)
    with (out / "rounds.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    _csv(out / "rounds.csv", rows)
    _csv(out / "per_device.csv", list(device_rows(sim)))
    result = summary(sim, rows, target)
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_perplexity_hours({"run": rows}, out / "perplexity_hours.png", target)
    plot_participation(sim, out / "participation.png")
    return result


def device_rows(sim: DeviceSim) -> Any:
    """One dict per device: tier, batch, memory exclusion and every counter."""
    c = sim.state.counters
    for d in range(len(sim.pop)):
        row: dict[str, Any] = {
            "device_id": d,
            "tier": sim.pop.tier_of(d),
            "batch": int(sim.batches[d]),
            "excluded_memory": bool(sim.excluded[d]),
            "step_seconds": float(sim.step_s[d]),
        }
        row.update({name: float(c[name][d]) for name in COUNTERS})
        yield row


def _csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """A run's ``devices/rounds.jsonl`` rows (empty when the run had no device simulation)."""
    path = run_dir / "devices" / "rounds.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_perplexity_hours(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], out: Path, target: float = 0.0
) -> Path:
    """Held-out perplexity against simulated hours, one line per run (strategy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, rows in runs.items():
        pts = [
            (r["hours"], r["perplexity"])
            for r in rows
            if isinstance(r.get("perplexity"), int | float)
        ]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    if target > 0:
        ax.axhline(target, color="grey", linestyle="--", label=f"target {target:g}")
    ax.set_xlabel("simulated hours")
    ax.set_ylabel("held-out perplexity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_participation(sim: DeviceSim, out: Path) -> Path:
    """Mean rounds trained per device of each tier, beside the memory exclusions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(sim.pop.tier_names)
    trained = sim.state.counters["trained"]
    means = [
        float(trained[sim.pop.tier == k].mean()) if (sim.pop.tier == k).any() else 0.0
        for k in range(len(names))
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.bar(names, means)
    ax.set_ylabel("rounds trained per device (mean)")
    ax.set_title(f"participation; {int(sim.excluded.sum())} devices excluded (memory)")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
