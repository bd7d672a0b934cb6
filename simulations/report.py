"""The demo's report: one Markdown file with its figures and plots, written into the run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPORT_NAME = "report.md"


def write_report(summary: dict[str, Any], run_dir: Path) -> Path:
    """Render `summary` (as `fedge demo` builds it) to `run_dir/report.md` with PNG plots beside it."""
    stages = summary["stages"]
    plots = {
        "rounds": _plot_rounds(stages["federation"], run_dir / "perplexity_rounds.png"),
        "acceptance": _plot_acceptance(
            stages["realignment"]["clients"], run_dir / "acceptance.png"
        ),
    }
    lines = [
        f"# fedge demo ({summary['preset']} zoo)",
        "",
        f"Run directory `{summary['run_dir']}`; {summary['seconds']} s in all "
        f"({', '.join(f'{k} {v} s' for k, v in summary['timings_s'].items())}). "
        "Round metrics for TensorBoard: `tensorboard --logdir "
        + f"{run_dir}` (one log per federation).",
        "",
        *_zoo_section(stages["zoo"]["card"]),
        *_federation_section(stages["federation"], plots["rounds"], run_dir),
        *population_section(stages["federation"], stages["population"]),
        *_realignment_section(stages["realignment"]["clients"], plots["acceptance"]),
        *_edge_section(stages["edge"]),
    ]
    path = run_dir / REPORT_NAME
    path.write_text("\n".join(lines) + "\n")
    return path


def write_pretrained_report(summary: dict[str, Any], run_dir: Path) -> Path:
    """Render a pretrained-model demo's summary (`fedge demo --preset smollm2`) to report.md."""
    stages = summary["stages"]
    plot = _plot_rounds(stages["federation"], run_dir / "perplexity_rounds.png")
    model, draft = stages["model"], stages["draft"]
    manifest = model.get("manifest") or {}
    card = draft.get("card") or {}
    federation = _federation_section(stages["federation"], plot, run_dir)
    federation[0] = "## 3-4. Federated LoRA on code instructions, plain and under SecAgg+ with DP"
    federation[2] = (
        "Perplexity of the base model and of the model with the federated adapter on held-out "
        "instruction responses (a function's body after its signature and docstring; the "
        "prompt is never scored): the participating clients' own packages and every package."
    )
    edge = _edge_section(stages["edge"])
    edge[0] = "## 6. Edge: the draft against the verifier serving the federated adapter"
    realignment = stages.get("realignment", {})
    lines = [
        f"# fedge demo ({summary['preset']} preset)",
        "",
        f"Run directory `{summary['run_dir']}`; {summary['seconds']} s in all "
        f"({', '.join(f'{k} {v} s' for k, v in summary['timings_s'].items())}); load average "
        f"{' -> '.join(str(v) for v in summary.get('load_average', []))}.",
        "",
        "## 1. The pretrained model",
        "",
        f"`{model['dir']}`: {manifest.get('parameters', '?')} parameters, "
        f"{(manifest.get('provenance') or {}).get('source', 'a local folder')}, "
        f"held-out perplexity {manifest.get('heldout_perplexity', '?')}.",
        "",
        "## 2. The draft",
        "",
        f"`{draft['dir']}` ({'cached' if draft.get('cached') else 'built in this run'}): "
        f"{card.get('layers', (card.get('spec') or {}).get('layers', '?'))} layers, "
        f"greedy agreement {card.get('greedy_agreement', '?')} after "
        f"{card.get('training_seconds', '?')} s of distillation.",
        "",
        *federation,
        "## 5. Draft realignment",
        "",
        f"Skipped: {realignment['skipped']}." if "skipped" in realignment else "Done.",
        "",
        *edge,
    ]
    path = run_dir / REPORT_NAME
    path.write_text("\n".join(lines) + "\n")
    return path


def _zoo_section(card: dict[str, Any]) -> list[str]:
    target, draft, agreement = card["target"], card["draft"], card["agreement"]
    own = f" ({draft['own_parameters']:,} own)" if "own_parameters" in draft else ""
    return [
        "## 1. Model zoo",
        "",
        "| model | parameters | training tokens | held-out perplexity |",
        "|---|---|---|---|",
        f"| target | {target['parameters']:,} | {target['training_tokens']:,} | "
        f"{target['heldout_perplexity']:.1f} |",
        f"| draft | {draft['parameters']:,}{own} | {draft['training_tokens']:,} | "
        f"{draft['heldout_perplexity']:.1f} |",
        "",
        f"Draft greedy agreement with the target {agreement['greedy_rate']:.1%}, "
        f"{agreement['tokens_per_verify_draft4']:.2f} tokens per verification at draft length 4.",
        "",
    ]


def _federation_section(federation: dict[str, Any], plot: str, run_dir: Path) -> list[str]:
    lines = [
        "## 2-3. Federated LoRA fine-tuning, plain and under SecAgg+ with distributed DP",
        "",
        "Perplexity of the base target and of the target with the federated adapter, on the "
        "participating clients' own held-out code and on the whole corpus's held-out code.",
        "",
        "| federation | clients | participating clients' code | whole corpus | epsilon |",
        "|---|---|---|---|---|",
    ]
    for run in (federation["plain"], federation["private"]):
        eps = f"{run['epsilon']:.2f}" if run["epsilon"] is not None else "-"
        lines.append(
            f"| {run['label']} | {run.get('clients', len(run['partitions']))} | "
            f"{_change(*run['participating_perplexity'])} | {_change(*run['corpus_perplexity'])} "
            f"| {eps} |"
        )
    plain = federation["plain"]["participating_perplexity"][1]
    private = federation["private"]["participating_perplexity"][1]
    privacy_png = Path(federation["private"]["run_dir"]) / "privacy.png"
    lines += [
        "",
        f"Cost of privacy on the clients' code: {private:.2f} vs {plain:.2f} "
        f"({(private - plain) / plain:+.1%}).",
        "",
        f"![perplexity per round]({plot})",
        "",
    ]
    if privacy_png.is_file():  # linked relative to the report, so the run directory can move
        lines += [f"![privacy]({os.path.relpath(privacy_png, run_dir)})", ""]
    return lines


def population_section(federation: dict[str, Any], population: dict[str, Any]) -> list[str]:
    """The population runs beside the 6-client ones: what privacy costs at each cohort size."""
    small_plain, small_private = federation["plain"], federation["private"]
    plain, private = population["plain"], population["private"]
    lines = [
        "## 4. Private learning at population scale",
        "",
        f"{plain['population']:,} simulated phones (built-in tiers, diurnal availability, a "
        "deadline) share the corpus in shards; each round draws a Poisson cohort from the phones "
        "eligible then, plain and under SecAgg+ with distributed DP with the same cohort law. "
        "Participants' held-out perplexity, base model -> federated adapter:",
        "",
        "| federation | clients per round | participants' code | epsilon (delta) | "
        "simulated hours |",
        "|---|---|---|---|---|",
    ]
    for run in (small_plain, small_private):
        eps = f"{run['epsilon']:.2f}" if run["epsilon"] is not None else "-"
        lines.append(
            f"| {_clients(run)} clients, {run['label']} | {_clients(run)} | "
            f"{_change(*run['participating_perplexity'])} | {eps} | - |"
        )
    for run in (plain, private):
        lines.append(
            f"| {run['population']:,} phones, {run['label']} | {run['mean_cohort']:.1f} | "
            f"{_change(*run['participating'])} | {_epsilon(run)} | {run['simulated_hours']:.2f} |"
        )
    small = _cost(
        small_plain["participating_perplexity"], small_private["participating_perplexity"]
    )
    large = _cost(plain["participating"], private["participating"])
    lines += [
        "",
        f"Cost of privacy against the plain run with the same clients: {small} with "
        f"{_clients(small_plain)} clients per round; {large} "
        f"with Poisson cohorts of K = {private['cohort']} ({private['mean_cohort']:.1f} drawn on "
        f"average) of {private['population']:,} phones.",
        "",
        *_population_caveats(small_private, plain, private),
        "",
        f"The stage took {population['seconds']} s ({plain['label']} {plain['wall_seconds']} s, "
        f"{private['label']} {private['wall_seconds']} s) for {private['rounds']} rounds.",
        "",
    ]
    return lines


def _clients(run: dict[str, Any]) -> int:
    """Most client updates aggregated in a round (older summaries: the partitions seen)."""
    return int(run.get("clients") or len(run.get("partitions", [])))


def _epsilon(run: dict[str, Any]) -> str:
    if run["epsilon"] is None:
        return "-"
    return f"{run['epsilon']:.2f} (1/{round(1 / run['delta']):,})"


def _cost(plain: list[float], private: list[float]) -> str:
    """'+7.9% (kept none of the plain run's -5.8%)': the private run against the plain one."""
    before, after, ours = plain[0], plain[1], private[1]
    gap = f"{(ours - after) / after:+.1%}"
    if after >= before:
        return f"{gap} (the plain run did not improve on the base model)"
    kept = (before - ours) / (before - after)
    share = f"{kept:.0%}" if kept > 0 else "none"
    return f"{gap} (kept {share} of the plain run's {(after - before) / before:+.1%})"


def _population_caveats(
    small: dict[str, Any], plain: dict[str, Any], private: dict[str, Any]
) -> list[str]:
    """What the population figures do and do not show, in words derived from them."""
    before, after = plain["participating"]
    gained = (before - after) / before
    lines = [
        f"Epsilon {private['epsilon']:.2f} ({private['accountant']}) is amplified by the Poisson "
        "draw: it holds against whoever sees only the released adapters. The server, which drew "
        f"the cohort, can claim only the unamplified {private['epsilon_server']:.2f}."
    ]
    if gained < 0.02:
        lines += [
            "",
            f"The plain population run itself gained only {gained:.1%} in {plain['rounds']} "
            "rounds, so a gap between runs this small says little (phones holding the corpus "
            'the base model was trained on, data-source "", leave it little to learn). What '
            f"the stage does show is the epsilon: {private['epsilon']:.2f} for cohorts of "
            f"{private['cohort']} phones against {small.get('epsilon') or float('inf'):.2f} for "
            f"{_clients(small)} "
            "clients.",
        ]
    return lines


def _realignment_section(clients: list[dict[str, Any]], plot: str) -> list[str]:
    lines = [
        "## 5. Draft realigned to the federated target (same federation, clients distil)",
        "",
        "Greedy agreement of draft with target on each client's held-out prompts "
        "(the acceptance rate of greedy speculative decoding).",
        "",
        "| client | base draft / base target | base draft / federated target | "
        "realigned draft / federated target |",
        "|---|---|---|---|",
    ]
    keys = ("base_vs_base", "base_vs_federated", "realigned_vs_federated")
    for c in clients:
        rates = [f"{c[k]:.1%}" if c[k] is not None else "n/a" for k in keys]
        lines.append(f"| {c['partition']} | " + " | ".join(rates) + " |")
    measured = _measured(clients)
    if measured:
        means = [sum(c[k] for c in measured) / len(measured) for k in keys]
        lines.append("| mean | " + " | ".join(f"{m:.1%}" for m in means) + " |")
    if len(measured) < len(clients):
        lines += ["", "n/a: the client's held-out code is too short to measure."]
    return [*lines, "", f"![acceptance per client]({plot})", ""]


def _measured(clients: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Clients whose held-out code was long enough to measure (their rates are not null)."""
    return [c for c in clients if c["realigned_vs_federated"] is not None]


def _edge_section(edge: dict[str, Any]) -> list[str]:
    steps = edge.get("decode_step_ms", {})
    fp32 = steps.get("fp32")
    variants = ", ".join(
        f"{k} {v:.3f} ms ({fp32 / v:.2f}x fp32)" if fp32 else f"{k} {v:.3f} ms"
        for k, v in steps.items()
    )
    return [
        "## 6. Edge: realigned quantized draft against the verifier serving the federated adapter",
        "",
        f"Draft runtime `{edge['draft_runtime']}`; decode step per variant: {variants}.",
        "",
        "| acceptance | target passes / token | speculative tok/s | cloud-only tok/s | "
        "greedy output = cloud's |",
        "|---|---|---|---|---|",
        f"| {edge['acceptance']:.2f} | {edge['passes_per_token']:.2f} | "
        f"{edge['speculative_tokens_per_s']:.0f} | {edge['cloud_only_tokens_per_s']:.0f} | "
        f"{'yes' if edge['greedy_identical'] else 'NO'} |",
        "",
        *_showcase_lines(edge.get("showcase")),
        "```json",
        json.dumps({k: v for k, v in edge.items() if k != "showcase"}, indent=2),
        "```",
    ]


def _showcase_lines(showcase: dict[str, Any] | None) -> list[str]:
    """A held-out prompt's greedy completion, the draft's accepted runs between « », and the
    true continuation."""
    if not showcase:
        return []
    return [
        "A held-out prompt's greedy completion; each run of draft tokens the target accepted is "
        "between « and »:",
        "",
        "```",
        showcase["prompt"] + showcase["marked"],
        "```",
        "",
        "What the held-out file really says next:",
        "",
        "```",
        showcase["prompt"] + showcase["truth"],
        "```",
        "",
    ]


def _plot_rounds(federation: dict[str, Any], out: Path) -> str:
    """Whole-corpus perplexity per round for the plain and the private federation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedge.server.rundir import MetricsLog

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in (federation["plain"], federation["private"]):
        rows = [r for r in MetricsLog(Path(run["run_dir"])).rows() if r.get("perplexity")]
        ax.plot(
            [r["round"] for r in rows], [r["perplexity"] for r in rows], "o-", label=run["label"]
        )
    ax.set(xlabel="round", ylabel="whole-corpus held-out perplexity", title="federation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def _plot_acceptance(clients: list[dict[str, Any]], out: Path) -> str:
    """Three bars per client: base/base, base/federated, realigned/federated agreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("base_vs_base", "base_vs_federated", "realigned_vs_federated")
    clients = _measured(clients)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.27
    for i, key in enumerate(keys):
        xs = [j + (i - 1) * width for j in range(len(clients))]
        ax.bar(xs, [c[key] for c in clients], width, label=key.replace("_", " "))
    ax.set_xticks(range(len(clients)), [str(c["partition"]) for c in clients])
    ax.set(xlabel="client", ylabel="greedy agreement", ylim=(0, 1), title="draft acceptance")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def _change(before: float, after: float) -> str:
    return f"{before:.2f} -> {after:.2f} ({(after - before) / before:+.1%})"
