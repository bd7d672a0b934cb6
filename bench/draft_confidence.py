"""Is a draft's confidence worth stopping on? Its calibration, and rounds replayed offline.

Along the target's greedy paths of held-out prompts, the draft's top probability at each
position is set against whether its choice is the target's (calibration bins). Those paths
then replay speculative rounds under a cost model (a draft step, a verify call's fixed cost
at each RTT, a cost per drafted token): the best fixed draft length against stopping a
round once the product of the draft's top probabilities falls below a floor
(`fedge.edge.decoder.DecodeConfig.confidence_floor`). Replay, not decoding: the live figure
is `bench/edge.py`'s. Usage::

    python bench/draft_confidence.py --target DIR --draft DIR [--prompts 64] [--results NAME]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

RESULTS = Path(__file__).parent / "results"
BINS = [0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
Rule = Callable[[int, float, float], bool]  # (drafted so far, product so far, next top prob)


def path_confidence(
    target_dir: Path, draft_dir: Path, prompts: int, new_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """(top probability, agrees) of the draft at each generated position of the target's paths."""
    from fedge.edge.prompts import heldout_prompts
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.zoo.draft import target_paths

    held = heldout_prompts(load_tokenizer(target_dir), prompts, 32)
    target = load_causal_lm(target_dir).eval()
    paths = torch.cat(
        [
            target_paths(target, torch.tensor(held[i : i + 16]), new_tokens)
            for i in range(0, prompts, 16)
        ]
    )
    del target
    draft = load_causal_lm(draft_dir).eval()
    start = len(held[0])
    with torch.no_grad():
        probs = draft(input_ids=paths[:, :-1]).logits[:, start - 1 :].float().softmax(-1)
    top, choice = probs.max(-1)
    return top.numpy(), (choice == paths[:, start:]).numpy()


def fixed_length(length: int) -> Rule:
    """Draft `length` tokens every round."""

    def rule(drafted: int, likely: float, top: float) -> bool:
        return drafted < length

    return rule


def confidence_floor(floor: float, most: int = 16) -> Rule:
    """Draft while the product of the top probabilities stays >= `floor` (one at least)."""

    def rule(drafted: int, likely: float, top: float) -> bool:
        return drafted < most and (drafted == 0 or likely * top >= floor)

    return rule


def replay(top: np.ndarray, agree: np.ndarray, rule: Rule, cost: dict[str, float]) -> float:
    """Tokens per second of greedy speculative rounds along the paths under `rule`."""
    tokens = seconds = 0.0
    for row in range(top.shape[0]):
        at, end = 0, top.shape[1]
        while at < end:
            drafted, likely = 0, 1.0
            while at + drafted < end and rule(drafted, likely, float(top[row, at + drafted])):
                likely *= float(top[row, at + drafted])
                drafted += 1
            accepted = 0
            while accepted < drafted and agree[row, at + accepted]:
                accepted += 1
            tokens += accepted + 1
            seconds += drafted * (cost["draft_step_s"] + cost["per_token_s"]) + cost["call_s"]
            at += accepted + 1
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--draft-step-ms", type=float, default=2.0, help="int8 SmolLM2 draft")
    parser.add_argument("--pass-ms", type=float, default=36.0, help="one-token verify pass")
    parser.add_argument("--per-token-ms", type=float, default=5.0, help="verify cost per draft")
    parser.add_argument("--rtts", default="0,20,100")
    parser.add_argument("--results", default="draft_confidence.json")
    args = parser.parse_args()
    load_start = os.getloadavg()
    top, agree = path_confidence(args.target, args.draft, args.prompts, args.new_tokens)
    flat_top, flat_agree = top.ravel(), agree.ravel()
    bins = []
    for low, high in itertools.pairwise(BINS):
        inside = (flat_top >= low) & (flat_top < high)
        bins.append(
            {
                "top_prob": [low, min(high, 1.0)],
                "share": round(float(inside.mean()), 4),
                "agreement": round(float(flat_agree[inside].mean()), 4) if inside.any() else None,
            }
        )
    replays = {}
    for rtt in (float(r) for r in args.rtts.split(",")):
        cost = {
            "draft_step_s": args.draft_step_ms / 1e3,
            "call_s": (args.pass_ms + rtt) / 1e3,
            "per_token_s": args.per_token_ms / 1e3,
        }
        fixed = {g: replay(top, agree, fixed_length(g), cost) for g in range(1, 17)}
        floors = {
            f: replay(top, agree, confidence_floor(f), cost) for f in (0.05, 0.1, 0.15, 0.2, 0.3)
        }
        best_g = max(fixed, key=lambda g: fixed[g])
        replays[f"{rtt:g}ms"] = {
            "best_fixed": {"draft_len": best_g, "tokens_per_s": round(fixed[best_g], 2)},
            "confidence_floor_tokens_per_s": {str(f): round(v, 2) for f, v in floors.items()},
            "floor_0.1_over_best_fixed": round(floors[0.1] / fixed[best_g], 3),
        }
    out = {
        "target": str(args.target),
        "draft": str(args.draft),
        "positions": int(flat_top.size),
        "agreement": round(float(flat_agree.mean()), 4),
        "calibration": bins,
        "cost_model_ms": {
            "draft_step": args.draft_step_ms,
            "verify_pass": args.pass_ms,
            "per_drafted_token": args.per_token_ms,
        },
        "replay": replays,
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.results).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
