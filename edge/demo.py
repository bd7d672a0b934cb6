"""The edge stage of `fedge demo`: export and quantize the draft, serve the adapted target, decode speculatively."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.export import ExportConfig, export_draft
from fedge.edge.prompts import heldout_examples
from fedge.edge.runtime import load_draft_runtime
from fedge.edge.showcase import Showcase, ShowcaseView, greedy_showcase
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.tables import wrapping_table

VALIDATION_PROMPTS = 8
DEMO_PROMPTS = 6
PROMPT_TOKENS = 32
NEW_TOKENS = 48
SAMPLE_TOKENS = 96
# Greedy decoding of a small model loops ("_C_C_C..."); sampling at a moderate temperature reads
# as code, and fedge's speculative sampling leaves the target's distribution exact.
SAMPLE_TEMPERATURE = 0.7
METRICS_NAME = "edge_metrics.json"
Example = tuple[list[int], list[int]]  # prompt ids, its true continuation's ids


@dataclass(frozen=True)
class EdgeSizes:
    """The edge stage's prompts and tokens (the zoo demo's defaults)."""

    validation_prompts: int = VALIDATION_PROMPTS  # the draft's export is validated on these
    prompts: int = DEMO_PROMPTS  # decoded speculatively and cloud-only, one row each
    new_tokens: int = NEW_TOKENS  # per prompt, greedy
    sample_tokens: int = SAMPLE_TOKENS  # the temperature-sampled completion
    prompt_tokens: int = PROMPT_TOKENS  # held-out text windows (when no examples are given)
    verifier_runtime: str = "torch"  # the target's runtime in the verifier (torch | onnx | auto)


def edge_stage(
    target_dir: Path,
    draft_dir: Path,
    adapter_dir: Path | None,
    run_dir: Path,
    console: Console,
    sizes: EdgeSizes | None = None,
    examples: list[Example] | None = None,
) -> dict[str, Any]:
    """Export + quantize `draft_dir`, serve target (+ adapter) on 127.0.0.1:0, generate, report, stop.

    `examples` (prompt, true continuation) replace the held-out text windows: the first
    `sizes.validation_prompts` validate the export, the next `sizes.prompts` are decoded.

    The edge runs the 4-bit draft when it validated (else the fastest valid variant). Returns
    (and writes to `run_dir/edge_metrics.json`) acceptance, tokens/s and target passes per
    token of speculative decoding, with cloud-only decoding beside it, and each variant's
    decode step.
    """
    from fedge.models import load_tokenizer

    size = sizes or EdgeSizes()
    validation, new_tokens = size.validation_prompts, size.new_tokens
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(target_dir)
    if examples is None:
        examples = heldout_examples(
            tokenizer, validation + size.prompts, size.prompt_tokens, new_tokens
        )
    if len(examples) < validation + size.prompts:
        raise ValueError(f"edge_stage needs {validation + size.prompts} examples")
    prompts = [prompt for prompt, _ in examples]
    stop = tokenizer.eos_token_id  # the shown completions end with the turn (speed rows run on)
    with console.status("exporting the draft to ONNX (fp32, int8, int4) and validating it"):
        manifest = export_draft(
            draft_dir, run_dir / "draft", prompts[:validation], ExportConfig(), target_dir
        )
    quantized = manifest["variants"].get("int4", {}).get("valid", False)
    runtime = load_draft_runtime(run_dir / "draft", "onnx-int4" if quantized else "auto")
    console.print(_variants_table(manifest))
    config = ServerConfig(
        target_dir,
        adapter_dir=adapter_dir,
        engine=EngineConfig(runtime=size.verifier_runtime),
        drain_notice_s=0.0,
    )
    rows: list[dict[str, Any]] = []
    distinct: list[int] = []  # distinct tokens in each prompt's greedy output (loops have few)
    with console.status("starting the verifier"), BackgroundServer(config) as server:
        console.print(
            f"verifier on 127.0.0.1:{server.port} serving target + {adapter_dir or 'no adapter'}"
        )
        with VerifierClient(ClientConfig(f"127.0.0.1:{server.port}")) as client:
            for i, prompt in enumerate(prompts[validation : validation + size.prompts]):
                decoder = SpeculativeDecoder(
                    runtime, client, DecodeConfig(max_new_tokens=new_tokens)
                )
                tokens = decoder.generate(prompt)
                distinct.append(len(set(tokens)))
                cloud = _cloud_only(client, prompt, new_tokens)
                stats = decoder.stats
                rows.append(
                    {
                        "prompt": i,
                        "tokens": stats.tokens,
                        "acceptance": stats.acceptance,
                        "passes_per_token": stats.passes_per_token,
                        "tokens_per_s": stats.tokens_per_second,
                        "cloud_tokens_per_s": cloud,
                        "identical_to_cloud_greedy": tokens
                        == list(client.generate(prompt, new_tokens)),
                    }
                )
            sample_prompt = prompts[validation]
            sampler = SpeculativeDecoder(
                runtime,
                client,
                DecodeConfig(
                    max_new_tokens=size.sample_tokens,
                    temperature=SAMPLE_TEMPERATURE,
                    seed=0,
                    stop_token_id=stop,
                ),
            )
            completion = sampler.generate(sample_prompt)
            # the least looping greedy output reads best: a small model's greedy text often repeats
            shown = validation + max(range(len(distinct)), key=distinct.__getitem__)
            showcase = greedy_showcase(
                runtime, client, tokenizer, prompts[shown], examples[shown][1], new_tokens, stop
            )
    summary = _summarize(rows, runtime.name, adapter_dir)
    summary["decode_step_ms"] = {
        k: round(v["decode_step_s"] * 1e3, 4) for k, v in manifest["variants"].items()
    }
    summary["sample"] = {
        "temperature": SAMPLE_TEMPERATURE,
        "prompt": tokenizer.decode(sample_prompt, skip_special_tokens=True),
        "completion": tokenizer.decode(completion, skip_special_tokens=True),
        "acceptance": round(sampler.stats.acceptance, 4),
    }
    summary["showcase"] = showcase.as_dict()
    summary["new_tokens"] = new_tokens
    console.print(_table(rows, summary))
    console.print(_greedy_line(summary))
    console.print(_sample_panel(summary["sample"]))
    (run_dir / METRICS_NAME).write_text(json.dumps({"summary": summary, "prompts": rows}, indent=2))
    return summary


def showcase_view(summary: dict[str, Any]) -> ShowcaseView:
    """The edge stage's greedy showcase (`summary["showcase"]`) as what the demo ends on (its
    prompt shown whole when ``instruction`` marks it as an instruction)."""
    shown = summary["showcase"]
    return ShowcaseView(
        Showcase.from_dict(shown),
        int(summary.get("new_tokens", NEW_TOKENS)),
        whole_prompt=bool(shown.get("instruction")),
    )


def _cloud_only(client: VerifierClient, prompt: list[int], new_tokens: int) -> float:
    """Tokens per second of the verifier's own streaming generation for the same prompt."""
    started = time.perf_counter()
    count = sum(1 for _ in client.generate(prompt, new_tokens))
    return count / (time.perf_counter() - started)


def _summarize(
    rows: list[dict[str, Any]], runtime: str, adapter_dir: Path | None
) -> dict[str, Any]:
    """Means over prompts."""
    mean = lambda key: sum(float(r[key]) for r in rows) / len(rows)  # noqa: E731
    return {
        "draft_runtime": runtime,
        "adapter_dir": str(adapter_dir) if adapter_dir else None,
        "prompts": len(rows),
        "acceptance": round(mean("acceptance"), 4),
        "passes_per_token": round(mean("passes_per_token"), 4),
        "speculative_tokens_per_s": round(mean("tokens_per_s"), 1),
        "cloud_only_tokens_per_s": round(mean("cloud_tokens_per_s"), 1),
        "greedy_identical": all(r["identical_to_cloud_greedy"] for r in rows),
    }


def _greedy_line(summary: dict[str, Any]) -> str:
    """The correctness line: speculative greedy output equals the cloud's on every prompt."""
    if summary["greedy_identical"]:
        return (
            f"[green]greedy speculative output identical to the cloud's on all "
            f"{summary['prompts']} prompts[/green]"
        )
    return "[red]greedy speculative output DIFFERS from the cloud's: see edge_metrics.json[/red]"


def _sample_panel(sample: dict[str, Any]) -> Group:
    """The prompt (dim) and its sampled completion, highlighted as the Python it imitates."""
    code = Text(_from_line_start(sample["prompt"]), style="dim")
    code.append_text(
        Syntax(sample["completion"], "python", theme="ansi_dark").highlight(sample["completion"])
    )
    caption = (
        f"speculative sampling at temperature {sample['temperature']}: exactly the target's "
        f"distribution; draft acceptance {sample['acceptance']:.2f}"
    )
    panel = Panel(code, title="a held-out prompt (dim) and its completion", title_align="left")
    return Group(panel, Text(caption, style="dim"))


def _from_line_start(prompt: str) -> str:
    """The prompt from its first whole line: a window of tokens usually starts mid-line."""
    _, newline, rest = prompt.partition("\n")
    return rest if newline and rest.strip() else prompt


def _variants_table(manifest: dict[str, Any]) -> Table:
    """Each exported variant: valid, agreement with the torch draft and the target, decode step, size."""
    table = wrapping_table(
        "draft exports (ONNX Runtime, one decode step after a short prefill)",
        (
            "variant",
            "valid",
            "agreement with torch",
            "with the target",
            "decode ms",
            "vs fp32",
            "bytes",
        ),
    )
    fp32 = manifest["variants"]["fp32"]["decode_step_s"]
    for name, v in manifest["variants"].items():
        table.add_row(
            name,
            "yes" if v["valid"] else "NO",
            f"{v['greedy_agreement']:.3f}",
            f"{v['target_agreement']:.3f}" if "target_agreement" in v else "-",
            f"{v['decode_step_s'] * 1e3:.3f}",
            f"{fp32 / v['decode_step_s']:.2f}x",
            f"{v['bytes']:,}",
        )
    return table


def _table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> Table:
    """Per-prompt figures with the mean as caption."""
    table = wrapping_table(
        "edge: speculative decoding against the verifier (greedy)",
        (
            "prompt",
            "tokens",
            "acceptance",
            "target passes per token",
            "tokens/s",
            "cloud-only tokens/s",
            "= cloud",
        ),
    )
    for r in rows:
        table.add_row(
            str(r["prompt"]),
            str(r["tokens"]),
            f"{r['acceptance']:.2f}",
            f"{r['passes_per_token']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['cloud_tokens_per_s']:.0f}",
            "yes" if r["identical_to_cloud_greedy"] else "NO",
        )
    table.caption = (
        f"mean acceptance {summary['acceptance']:.2f}, {summary['passes_per_token']:.2f} target passes "
        f"per token, draft runtime {summary['draft_runtime']}"
    )
    return table
