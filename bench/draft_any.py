"""A draft for a pretrained target: `fedge models draft` on SmolLM2-135M, the agreement curve.

Builds (or, with --resume, continues) a draft from the target's first layers with a
restricted vocabulary, distilled on the target's outputs for a wall-time budget, and records
greedy agreement with the target on held-out stdlib prompts at each checkpoint: the
agreement-vs-build-time curve the issue asks for. Nothing here is tuned to a figure.

Usage: ``python bench/draft_any.py [--target DIR] [--minutes M] [--layers K] [--vocab N]
[--resume]``; the last line printed is one JSON object, also written to
``bench/results/draft_any.json``.
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
    args = parser.parse_args()
    if not (args.target / "config.json").is_file():
        sys.exit(f"no model at {args.target}: run `fedge models fetch smollm2-135m` first")
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
