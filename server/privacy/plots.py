"""Plot the privacy a run spent next to its utility: epsilon and perplexity per round."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedge.privacy.wire import MET_DPSGD_EPSILON

# Columns of a metrics row this part adds or reads.
COL_EPSILON = "epsilon"  # the server budget's cumulative user-level epsilon
COL_DPSGD_EPSILON = "dp_sgd_epsilon"  # the largest cumulative DP-SGD epsilon a client reported


def dpsgd_epsilon(per_client: Sequence[Mapping[str, float]]) -> float:
    """The largest cumulative DP-SGD epsilon among a round's clients (NaN when none ran DP-SGD)."""
    values = [m[MET_DPSGD_EPSILON] for m in per_client if MET_DPSGD_EPSILON in m]
    return max(values) if values else math.nan


def _points(rows: Sequence[Mapping[str, Any]], column: str) -> list[tuple[int, float]]:
    out = []
    for r in rows:
        value = r.get(column)
        if (
            r.get("status") in ("ok", "empty", "out-of-bounds")
            and value is not None
            and math.isfinite(float(value))
        ):
            out.append((int(r["round"]), float(value)))
    return out


def plot_privacy(rows: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """Two panels over rounds: epsilon spent (server and DP-SGD) and held-out perplexity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (eps_ax, ppl_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for ax in (eps_ax, ppl_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for column, label in (
        (COL_EPSILON, "user-level (server)"),
        (COL_DPSGD_EPSILON, "DP-SGD (max client)"),
    ):
        pts = _points(rows, column)
        if any(v > 0 for _, v in pts):
            eps_ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    eps_ax.set_xlabel("round")
    eps_ax.set_ylabel("cumulative epsilon")
    eps_ax.set_title("Privacy spent")
    eps_ax.grid(alpha=0.3)
    if eps_ax.get_legend_handles_labels()[0]:
        eps_ax.legend()
    pts = _points(rows, "perplexity")
    ppl_ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color="tab:green")
    ppl_ax.set_xlabel("round")
    ppl_ax.set_ylabel("held-out perplexity")
    ppl_ax.set_title("Utility")
    ppl_ax.grid(alpha=0.3)
    return save_figure(fig, out)


def save_figure(fig: Any, out: Path) -> Path:
    """Lay out ``fig``, write it to ``out`` as a PNG (creating the folder) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
