"""Benchmark quantized ONNX drafts against their fp32 export: decode step time by width, and acceptance.

1. Crossover by width: randomly initialised Llama drafts (2 layers, vocabulary 4096, a fixed
   seed) at several widths, each exported to ONNX fp32, dynamic int8 and 4-bit weight-only
   (MatMulNBits); the median single-token decode step after a 100-token prefill, one thread,
   the variants interleaved round by round so machine noise hits them alike. Quantization
   pays only where matrix work outweighs per-op overhead: the table says from which width.
2. The zoo's draft (``--preset``): the same three variants of the real export, their decode
   step, and greedy speculative decoding against the zoo's target in process (draft length 4,
   not adaptive) on held-out prompts: acceptance and target passes per token per variant, and
   whether every variant's output equals the target's own greedy output.

Usage: ``python bench/draft_quant.py [--preset default] [--widths 64,128,192,256,384,512]
[--prompts 8] [--new-tokens 48] [--reps 7] [--docs docs/edge.md]``. The last line printed is one
JSON object, also written to ``bench/results/draft_quant.json``; ``--docs`` rewrites the
crossover table between the draft-quant markers of that file from the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "draft_quant.json"
DOCS_START, DOCS_END = "<!-- draft-quant:start -->", "<!-- draft-quant:end -->"
VARIANTS = ("fp32", "int8", "int4")
PREFILL = 100  # tokens in the cache when a decode step is timed
STEPS = 40  # decode steps timed per variant and round
PROMPT_TOKENS = 32
DRAFT_LEN = 4


def decode_step_ms(runtimes: dict[str, Any], reps: int) -> dict[str, float]:
    """Median single-token step (ms) per runtime, the runtimes interleaved in every round."""
    samples: dict[str, list[float]] = {name: [] for name in runtimes}
    for _ in range(reps):
        for name, runtime in runtimes.items():
            runtime.reset()
            runtime.extend(list(range(1, PREFILL + 1)))
            times = []
            for i in range(STEPS):
                started = time.perf_counter()
                runtime.extend([5 + i % 7])
                times.append(time.perf_counter() - started)
            samples[name].append(float(np.median(times)))
    return {name: float(np.median(v)) * 1e3 for name, v in samples.items()}


def crossover(widths: list[int], reps: int, work: Path) -> list[dict[str, Any]]:
    """Decode step of fp32, int8 and int4 exports of random 2-layer drafts at each width."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedge.edge.export import _geometry, export_onnx, quantize_int4, quantize_int8
    from fedge.edge.runtime import OnnxDraftRuntime

    rows = []
    for width in widths:
        heads = max(2, width // 64)
        config = LlamaConfig(
            vocab_size=4096,
            hidden_size=width,
            intermediate_size=width * 8 // 3 // 16 * 16,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        fp32 = work / f"w{width}.fp32.onnx"
        past = export_onnx(model, fp32)
        quantize_int8(fp32, work / f"w{width}.int8.onnx")
        quantize_int4(fp32, work / f"w{width}.int4.onnx")
        manifest = {**_geometry(model), "past_names": past}
        runtimes = {
            v: OnnxDraftRuntime(work / f"w{width}.{v}.onnx", manifest, v, threads=1)
            for v in VARIANTS
        }
        ms = decode_step_ms(runtimes, reps)
        rows.append(
            {
                "width": width,
                "parameters": sum(p.numel() for p in model.parameters()),
                "decode_step_ms": ms,
                "speedup_over_fp32": {v: ms["fp32"] / ms[v] for v in VARIANTS},
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def zoo_draft(preset: str, prompts: int, new_tokens: int, reps: int, work: Path) -> dict[str, Any]:
    """Export the zoo's draft, time each variant's decode step and measure its acceptance."""
    from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
    from fedge.edge.export import ExportConfig, export_draft
    from fedge.edge.prompts import heldout_prompts
    from fedge.edge.runtime import load_draft_runtime
    from fedge.edge.verifier.engine import EngineConfig, VerifierEngine
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.zoo import ensure_zoo

    zoo = ensure_zoo(preset)
    pool = heldout_prompts(load_tokenizer(zoo.target_dir), 8 + prompts, PROMPT_TOKENS)
    manifest = export_draft(zoo.draft_dir, work / "draft", pool[:8], ExportConfig(), zoo.target_dir)
    valid = [v for v in VARIANTS if manifest["variants"][v]["valid"]]
    runtimes = {v: load_draft_runtime(work / "draft", f"onnx-{v}", threads=1) for v in valid}
    ms = decode_step_ms(runtimes, reps)
    engine = VerifierEngine(load_causal_lm(zoo.target_dir), EngineConfig(batch_window_s=0.0))
    config = DecodeConfig(max_new_tokens=new_tokens, draft_len=DRAFT_LEN, adaptive=False)
    variants: dict[str, Any] = {}
    engine.start()
    try:
        reference = [_cloud_greedy(engine, p, new_tokens) for p in pool[8:]]
        for v in valid:
            decoder = SpeculativeDecoder(runtimes[v], engine, config)
            drafted = accepted = rounds = tokens = 0
            identical = True
            for prompt, expected in zip(pool[8:], reference, strict=True):
                identical &= decoder.generate(prompt) == expected
                s = decoder.stats
                drafted, accepted = drafted + s.drafted, accepted + s.accepted
                rounds, tokens = rounds + s.rounds, tokens + s.tokens
            variants[v] = {
                "decode_step_ms": ms[v],
                "speedup_over_fp32": ms["fp32"] / ms[v],
                "acceptance": accepted / drafted,
                "target_passes_per_token": rounds / tokens,
                "output_equals_target_greedy": identical,
                "bytes": manifest["variants"][v]["bytes"],
                "greedy_agreement_with_torch": manifest["variants"][v]["greedy_agreement"],
            }
    finally:
        engine.stop()
    for name in manifest["variants"]:
        variants.setdefault(
            name, {"valid": False, "failures": manifest["variants"][name]["failures"]}
        )
    return {"preset": preset, "prompts": prompts, "new_tokens": new_tokens, "variants": variants}


def _cloud_greedy(engine: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy continuation, verifying an empty draft each step."""
    info = engine.open(prompt)
    try:
        out: list[int] = []
        while len(out) < new_tokens:
            out.append(engine.verify(info.session_id, [], [], []).next_token)
        return out
    finally:
        engine.close(info.session_id)


def markdown(result: dict[str, Any]) -> str:
    """The crossover table and the zoo draft's figures as Markdown."""
    lines = [
        "| width | parameters | fp32 ms | int8 ms (x fp32) | int4 ms (x fp32) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["crossover"]:
        ms, up = row["decode_step_ms"], row["speedup_over_fp32"]
        lines.append(
            f"| {row['width']} | {row['parameters']:,} | {ms['fp32']:.3f} | "
            f"{ms['int8']:.3f} ({up['int8']:.2f}x) | {ms['int4']:.3f} ({up['int4']:.2f}x) |"
        )
    zoo = result["zoo_draft"]
    lines += [
        "",
        f"The `{zoo['preset']}` zoo's draft, speculative decoding against its target in process "
        f"(greedy, draft length 4, {zoo['prompts']} held-out prompts x {zoo['new_tokens']} tokens):",
        "",
        "| variant | decode ms (x fp32) | acceptance | target passes / token | output = target's |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, v in zoo["variants"].items():
        if "acceptance" not in v:
            lines.append(f"| {name} | invalid: {v.get('failures')} | | | |")
            continue
        lines.append(
            f"| {name} | {v['decode_step_ms']:.3f} ({v['speedup_over_fp32']:.2f}x) | "
            f"{v['acceptance']:.3f} | {v['target_passes_per_token']:.3f} | "
            f"{'yes' if v['output_equals_target_greedy'] else 'NO'} |"
        )
    before, after = result["load_average_before"][0], result["load_average_after"][0]
    lines += ["", f"Load average (1 min) {before:.1f} before, {after:.1f} after."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--widths", default="64,128,192,256,384,512")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--docs", type=Path, default=None, help="Rewrite the table in this file.")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fedge-bench-quant-"))
    result: dict[str, Any] = {
        "threads": 1,
        "prefill_tokens": PREFILL,
        "load_average_before": os.getloadavg(),
        "crossover": crossover([int(w) for w in args.widths.split(",")], args.reps, work),
        "zoo_draft": zoo_draft(args.preset, args.prompts, args.new_tokens, args.reps, work),
        "load_average_after": os.getloadavg(),
    }
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2) + "\n")
    if args.docs is not None:
        from fedge.zoo.table import replace_in

        text = args.docs.read_text()
        args.docs.write_text(replace_in(text, markdown(result), DOCS_START, DOCS_END))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
