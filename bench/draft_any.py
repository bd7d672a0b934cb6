"""A draft for a pretrained target: `fedge models draft` on SmolLM2-135M, the agreement curve.

Builds (or, with --resume, continues) a draft from the target's first layers with a
restricted vocabulary, distilled on the target's outputs for a wall-time budget, and records
greedy agreement with the target on held-out stdlib prompts at each checkpoint: the
agreement-vs-build-time curve the issue asks for. Nothing here is tuned to a figure.

Usage: ``python bench/draft_any.py [--target DIR] [--minutes M] [--layers K] [--vocab N]
[--resume]``; the last line printed is one JSON object, also written to
``bench/results/draft_any.json``. ``--check DRAFT`` builds nothing: it measures a built draft's
greedy agreement with the target on the larger held-out check (``--check-prompts``, default
64, prompts x 48 tokens, spaced evenly through the held-out split; the target's fp32 paths
cached under $FEDGE_HOME/bench) and prints it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "draft_any.json"
CHECK_PROMPTS, CHECK_PROMPT_TOKENS, CHECK_NEW_TOKENS = 64, 32, 48  # --check defaults


def heldout_check(
    target_dir: Path, draft_dir: Path, count: int = CHECK_PROMPTS
) -> dict[str, object]:
    """The draft's teacher-forced greedy agreement with the target on `count` held-out prompts x
    48 target tokens, and how much of that path the draft's restricted vocabulary covers."""
    import torch

    from fedge.lm.bos import bos_token_id
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.paths import fedge_home
    from fedge.zoo.draft import VOCAB_NAME, DraftSpec, cached_paths, path_agreement, token_streams

    tokenizer = load_tokenizer(target_dir)
    _, heldout = token_streams(tokenizer, DraftSpec().max_chars_per_label)
    paths = cached_paths(
        fedge_home() / "bench" / f"{target_dir.name}-paths-{count}x{CHECK_NEW_TOKENS}.npy",
        load_causal_lm(target_dir).eval(),
        heldout,
        count,
        CHECK_PROMPT_TOKENS,
        CHECK_NEW_TOKENS,
        bos_token_id(tokenizer),
    )
    prompt_len = paths.shape[1] - CHECK_NEW_TOKENS
    draft = load_causal_lm(draft_dir).eval()
    ids = torch.tensor(json.loads((draft_dir / VOCAB_NAME).read_text()))
    return {
        "draft": str(draft_dir),
        "prompts": count,
        "new_tokens": CHECK_NEW_TOKENS,
        "positions": count * CHECK_NEW_TOKENS,
        "greedy_agreement": round(path_agreement(draft, paths, prompt_len), 4),
        "restricted_vocab_coverage_of_target_path": round(
            float(torch.isin(paths[:, prompt_len:], ids).float().mean()), 4
        ),
        "load": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    from fedge.paths import fedge_home
    from fedge.zoo.draft import DraftSpec, build_draft
    from fedge.zoo.presets import DRAFT_MINUTES

    defaults = DraftSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=fedge_home() / "models" / "smollm2-135m")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--minutes", type=float, default=DRAFT_MINUTES)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--last-layers", type=int, default=defaults.last_layers)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--greedy-rows", type=int, default=defaults.greedy_rows)
    parser.add_argument("--greedy-share", type=float, default=defaults.greedy_share)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--check", type=Path, default=None, help="a built draft: measure only")
    parser.add_argument("--check-prompts", type=int, default=CHECK_PROMPTS)
    args = parser.parse_args()
    if not (args.target / "config.json").is_file():
        sys.exit(f"no model at {args.target}: run `fedge models fetch smollm2-135m` first")
    if args.check is not None:
        print(json.dumps(heldout_check(args.target, args.check, args.check_prompts)))
        return
    out = args.out or args.target.with_name(args.target.name + "-draft")
    spec = DraftSpec(
        layers=args.layers,
        last_layers=args.last_layers,
        vocab=args.vocab,
        steps=args.steps,
        eval_every=args.eval_every,
        greedy_rows=args.greedy_rows,
        greedy_share=args.greedy_share,
        lr=args.lr,
    )
    card = build_draft(
        args.target,
        out,
        spec,
        minutes=args.minutes,
        resume=args.resume,
        progress=lambda point: print(json.dumps(point), flush=True),
    )
    result = {"draft": str(out), "cpu_count": os.cpu_count(), **card}
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
