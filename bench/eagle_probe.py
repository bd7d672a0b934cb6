"""EAGLE-style draft probe for SmolLM2-135M: a one-layer head on the target's own features.

A research measurement for issue 34 (not product code). The layer-skip draft
(`fedge.zoo.draft`) sees tokens only and is data-bound: the target's greedy rows it learns
from are expensive to generate on CPU. An EAGLE-1 head (Li et al. 2024) sees the TARGET's
last-layer feature of the previous position, and learns from plain teacher-forced target
forwards (one forward gives every position's feature, no generation), so data is cheap.

- Feature f_t: the output of the target's last decoder layer at position t, BEFORE the final
  norm (captured by a hook on that layer; the script records what `hidden_states[-1]` is).
- Head: concat(embed(x_{t+1}), f_t) -> Linear(2d, d) -> one Llama decoder layer (initialised
  from the target's last layer, causal over all earlier positions, RoPE at position t) -> g_{t+1}
  (the predicted f_{t+1}) -> the target's final norm -> the target's output rows of the 8,192
  most frequent training ids (+ specials): logits for x_{t+2}. Embedding, norm, rows frozen.
- Loss (EAGLE-1): smooth-L1(g_{t+1}, f_{t+1}) + 0.1 x cross-entropy to the target's softmax
  over the restricted rows at t+1 (KL up to a constant); inputs f_t get uniform noise
  U(-0.1, 0.1) x the feature's standard deviation.
- Data: stdlib training windows (128 tokens, batch 8); each step one no-grad target forward.
- Evaluation on the target's greedy paths of 64 held-out prompts x 48 tokens:
  (a) one-step agreement with the true f_t and x_{t+1} (the first drafted token after a
  verify); (b) chained drafting (the head feeds its own g and argmax token back) simulated as
  `bench/edge.py`'s `speculative_floor` does (draft up to 16, capped at the request's end),
  plus the extra first verify EAGLE needs (the prompt's prefill: no feature before it);
  (c) the same for the layer-skip draft (its own token-only greedy continuation);
  per-position acceptance i = 0..7 for both; cost per token in multiply-adds.

Usage: ``python bench/eagle_probe.py [--minutes 40] [--draft $FEDGE_HOME/models/smollm2-135m-draft] [--smoke]``; the
last line printed is one JSON object, also written to ``bench/results/eagle_probe.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench._common import loadavg, rounded, write_result

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "eagle_probe.json"
NOISE = 0.1  # uniform input noise, in units of the feature's standard deviation


class EagleHead(nn.Module):
    """concat(embed(x_{t+1}), f_t) -> fc -> one decoder layer -> g_{t+1}; logits via norm + rows."""

    def __init__(self, target: Any, ids: torch.Tensor) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        cfg = target.config.__class__.from_dict(target.config.to_dict())
        cfg.num_hidden_layers = 1
        width = int(cfg.hidden_size)
        self.head_dim = int(getattr(cfg, "head_dim", None) or width // cfg.num_attention_heads)
        self.fc = nn.Linear(2 * width, width)
        self.layer = LlamaDecoderLayer(cfg, layer_idx=0)
        self.layer.load_state_dict(target.model.layers[-1].state_dict())
        # frozen parts shared with the target (not registered: not trained, not counted)
        self._frozen = {
            "embed": target.model.embed_tokens,
            "norm": target.model.norm,
            "rotary": target.model.rotary_emb,
        }
        head = target.get_output_embeddings().weight.detach()
        self.register_buffer("ids", ids, persistent=False)
        self.register_buffer("rows", head[ids].clone(), persistent=False)

    def forward(
        self,
        feats: torch.Tensor,
        tokens: torch.Tensor,
        start: int,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """g for inputs (feats[:, i], tokens[:, i]) at positions start + i; returns g and the
        layer's keys/values including `past` (a KV cache: decode steps pass T = 1)."""
        embed = self._frozen["embed"](tokens)
        h = self.fc(torch.cat([embed.to(feats.dtype), feats], -1))
        batch, length, _ = h.shape
        positions = torch.arange(start, start + length).unsqueeze(0)
        cos, sin = self._frozen["rotary"](h, positions)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer, attn = self.layer, self.layer.self_attn
        x = layer.input_layernorm(h)
        shape = (batch, length, -1, self.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            if length != 1:
                raise ValueError("with a KV cache the head decodes one position at a time")
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=past is None and length > 1, enable_gqa=True
        )
        h = h + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, (k, v)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._frozen["norm"](g) @ self.rows.T.to(g.dtype)
        return out


class Features:
    """The target's pre-norm last-layer output and restricted logits from one forward."""

    def __init__(self, target: Any, rows: torch.Tensor) -> None:
        self.target, self.rows = target, rows
        self._seen: list[torch.Tensor] = []
        target.model.layers[-1].register_forward_hook(lambda _m, _i, out: self._seen.append(out))

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._seen.clear()
        normed = self.target.model(input_ids=tokens).last_hidden_state
        feats = self._seen[-1]
        feats = feats[0] if isinstance(feats, tuple) else feats
        return feats.float(), (normed @ self.rows.T.to(normed.dtype)).float()

    @torch.no_grad()
    def what_hidden_states_last_is(self, tokens: torch.Tensor) -> str:
        self._seen.clear()
        out = self.target.model(input_ids=tokens, output_hidden_states=True)
        pre = self._seen[-1]
        pre = pre[0] if isinstance(pre, tuple) else pre
        last = out.hidden_states[-1]
        if torch.allclose(last, pre):
            return "pre-norm (the last decoder layer's output)"
        if torch.allclose(last, out.last_hidden_state):
            return "post-norm (equal to last_hidden_state)"
        return "neither"


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def one_step(head: EagleHead, feats: torch.Tensor, paths: torch.Tensor, prompt_len: int) -> float:
    """(a): with the true f_t and x_{t+1}, the head's argmax vs path[t+2], t+2 over the new tokens."""
    g, _ = head(feats[:, :-1], paths[:, 1:], 0)
    choice = head.ids[head.logits(g).argmax(-1)]  # position t predicts x_{t+2}
    return float((choice[:, prompt_len - 2 : -1] == paths[:, prompt_len:]).float().mean())


@torch.no_grad()
def eagle_runs(
    head: EagleHead, feats: torch.Tensor, paths: torch.Tensor, prompt_len: int, max_draft: int
) -> tuple[np.ndarray, np.ndarray]:
    """runs[:, m]: drafted tokens matching the path after a verify that left path[:P+m] known
    (features f_0..f_{P+m-2}), m = 1..new-1; the head chains its own g and argmax tokens.
    Also (B, new, max_draft) booleans: drafted token i matched (where the path has it)."""
    batch, length = paths.shape
    new = length - prompt_len
    g_true, (keys, values) = head(feats[:, :-1], paths[:, 1:], 0)
    runs = np.zeros((batch, new), dtype=np.int64)
    hits = np.zeros((batch, new, max_draft), dtype=np.int8)
    for m in range(1, new):
        p = prompt_len + m - 2  # the last position whose target feature the verify computed
        past = (keys[:, :, : p + 1], values[:, :, : p + 1])
        g = g_true[:, p : p + 1]
        drafted = []
        for j in range(min(max_draft, length - 1 - (p + 1))):
            token = head.ids[head.logits(g).argmax(-1)]  # (B, 1): x_{p+2+j}
            drafted.append(token)
            if j + 1 < max_draft and p + 2 + j < length - 1:
                g, past = head(g, token, p + 1 + j, past)
        got = torch.cat(drafted, 1)
        want = paths[:, p + 2 : p + 2 + got.shape[1]]
        match = (got == want).numpy()
        hits[:, m, : match.shape[1]] = np.where(match, 1, -1)
        runs[:, m] = _runs(match)
    return runs, hits


@torch.no_grad()
def layer_skip_runs(
    draft: Any, paths: torch.Tensor, prompt_len: int, max_draft: int
) -> tuple[np.ndarray, np.ndarray]:
    """runs[:, m]: the draft's own greedy continuation of path[:P+m] matching the path, m = 0..new-1."""
    batch, length = paths.shape
    new = length - prompt_len
    runs = np.zeros((batch, new), dtype=np.int64)
    hits = np.zeros((batch, new, max_draft), dtype=np.int8)
    for m in range(new):
        known = paths[:, : prompt_len + m]
        want = paths[:, prompt_len + m : prompt_len + m + max_draft]
        out = draft.generate(
            known,
            attention_mask=torch.ones_like(known),
            max_new_tokens=want.shape[1],
            min_new_tokens=want.shape[1],
            do_sample=False,
            pad_token_id=0,
        )[:, known.shape[1] :]
        match = (out == want).numpy()
        hits[:, m, : match.shape[1]] = np.where(match, 1, -1)
        runs[:, m] = _runs(match)
    return runs, hits


def _runs(match: np.ndarray) -> np.ndarray:
    """Leading run of True per row."""
    miss = ~match
    first = np.where(miss.any(1), miss.argmax(1), match.shape[1])
    return first.astype(np.int64)


def simulate(runs: np.ndarray, first: int, max_draft: int) -> dict[str, float]:
    """`speculative_floor`'s loop: a verify at `made` accepts min(run, k) + 1, k capped at the end.

    `first` = 1 when the first verify can carry no draft (EAGLE: the prompt's prefill)."""
    batch, new = runs.shape
    verifies = 0
    for row in runs:
        made, count = first, first
        while made < new:
            k = min(max_draft, new - made - 1)
            made += min(int(row[made]), k) + 1
            count += 1
        verifies += count
    return {
        "max_draft": max_draft,
        "verifies_per_request": verifies / batch,
        "round_trips_per_token": verifies / (batch * new),
        "tokens_per_verify": batch * new / verifies,
    }


def acceptance(hits: np.ndarray, upto: int = 8) -> list[float]:
    """P(drafted token i matches | tokens 0..i-1 matched), over every chain start, i < upto."""
    out = []
    for i in range(upto):
        prior = np.all(hits[:, :, :i] == 1, axis=2) if i else np.ones(hits.shape[:2], bool)
        here = prior & (hits[:, :, i] != 0)
        out.append(float((hits[:, :, i][here] == 1).mean()) if here.any() else math.nan)
    return out


def floor_figures(runs: np.ndarray, hits: np.ndarray, first: int) -> dict[str, Any]:
    starts = runs[:, first:]
    return {
        "speculative_floor_k16": simulate(runs, first, 16),
        "k4": simulate(runs, first, 4),
        "k8": simulate(runs, first, 8),
        "draft_agreement_on_target_path": float((starts > 0).mean()),  # `speculative_floor`'s
        "mean_run_k16": float(starts.mean()),
        "acceptance_by_position": acceptance(hits[:, first:]),
    }


# ---------------------------------------------------------------- main
def main() -> None:
    from fedge.edge.prompts import heldout_prompts
    from fedge.lm.bos import bos_token_id, cut_windows
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.paths import fedge_home
    from fedge.zoo.draft import (
        draft_cost,
        path_agreement,
        restricted_vocabulary,
        target_paths,
        token_streams,
    )
    from fedge.zoo.training import autocast_context, bf16_is_fast

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=fedge_home() / "models" / "smollm2-135m")
    parser.add_argument(
        "--draft", type=Path, default=fedge_home() / "models" / "smollm2-135m-draft"
    )
    parser.add_argument("--minutes", type=float, default=40.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--max-draft", type=int, default=16)
    parser.add_argument(
        "--cls-weight", type=float, default=0.1, help="EAGLE-1: 0.1 (regression weight 1.0)"
    )
    parser.add_argument(
        "--std-units",
        action="store_true",
        help="regress g / feature std on f / feature std (EAGLE-1: raw features)",
    )
    parser.add_argument("--save-head", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_FILE)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.eval_every, args.batch = 4, 8, 2, 2
    torch.set_num_threads(2)
    torch.manual_seed(0)
    load_start = loadavg()
    began = time.perf_counter()

    tokenizer = load_tokenizer(args.target)
    bos = bos_token_id(tokenizer)
    target: Any = load_causal_lm(args.target).eval()
    target.requires_grad_(False)
    vocab_size = int(target.get_output_embeddings().weight.shape[0])
    train, heldout = token_streams(tokenizer, 100_000)
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id]
    ids_np = restricted_vocabulary(train, vocab_size, 8192, [t for t in specials if t is not None])
    ids = torch.from_numpy(ids_np)
    coverage = float(np.isin(heldout, ids_np).mean())
    head_rows = target.get_output_embeddings().weight.detach()[ids]
    features = Features(target, head_rows)
    probe = torch.from_numpy(cut_windows(train, [0], 16, bos))
    hidden_states_last = features.what_hidden_states_last_is(probe)

    # the evaluation paths: the target's greedy continuations of held-out prompts
    prompts = heldout_prompts(tokenizer, args.prompts, 32)
    prompt_len = len(prompts[0])
    paths = torch.cat(
        [
            target_paths(target, torch.tensor(prompts[i : i + 16]), args.new_tokens)
            for i in range(0, len(prompts), 16)
        ]
    )
    eval_feats, _ = features(paths[:, :-1])  # f_t for t = 0..L-2 (f_{L-1} is never an input)
    eval_feats = torch.cat([eval_feats, eval_feats[:, -1:]], 1)  # pad: only [:, :-1] is read
    subset = slice(0, min(16, len(prompts)))
    setup_s = time.perf_counter() - began
    print(f"setup {setup_s:.0f} s; hidden_states[-1] is {hidden_states_last}", file=sys.stderr)

    head = EagleHead(target, ids)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup, budget_s = 50, args.minutes * 60
    rng = np.random.default_rng(0)
    first = torch.from_numpy(cut_windows(train, rng.integers(0, len(train) - 200, 8), 128, bos))
    feat_std = float(features(first)[0].std())
    curve: list[dict[str, Any]] = []
    head.eval()
    curve.append(
        {
            "step": 0,
            "seconds": 0.0,
            "one_step_agreement_16": one_step(head, eval_feats[subset], paths[subset], prompt_len),
            "load": loadavg(),
        }
    )
    print(curve[-1], file=sys.stderr)
    head.train()
    step, sums = 0, np.zeros(3)
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s or (args.smoke and step >= 4):
            break
        fraction = min(1.0, elapsed / budget_s)
        lr = (
            args.lr
            * min(1.0, (step + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * fraction)))
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train) - args.context - 2, size=args.batch)
        tokens = torch.from_numpy(cut_windows(train, starts, args.context, bos))
        with autocast_context():
            feats, teacher = features(tokens)
            noisy = feats[:, :-1] + (torch.rand_like(feats[:, :-1]) * 2 - 1) * NOISE * feat_std
            g, _ = head(noisy, tokens[:, 1:], 0)
            logits = head.logits(g).float()
        scale = feat_std if args.std_units else 1.0
        regression = F.smooth_l1_loss(g.float() / scale, feats[:, 1:] / scale)
        classification = -(teacher[:, 1:].softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        loss = regression + args.cls_weight * classification
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        step += 1
        sums += [loss.item(), regression.item(), classification.item()]
        if step % args.eval_every == 0:
            head.eval()
            rate = one_step(head, eval_feats[subset], paths[subset], prompt_len)
            head.train()
            seconds = time.perf_counter() - start
            n = args.eval_every
            curve.append(
                {
                    "step": step,
                    "seconds": round(seconds, 1),
                    "s_per_step": round(seconds / step, 3),
                    "loss": sums[0] / n,
                    "regression": sums[1] / n,
                    "classification": sums[2] / n,
                    "lr": lr,
                    "one_step_agreement_16": rate,
                    "load": loadavg(),
                }
            )
            sums[:] = 0
            print(rounded(curve[-1]), file=sys.stderr, flush=True)
    train_s = time.perf_counter() - start
    load_end_train = loadavg()
    head.eval()
    if args.save_head:
        torch.save({k: v for k, v in head.state_dict().items()}, args.save_head)

    # (a), (b): the EAGLE head on all prompts
    eval_began = time.perf_counter()
    rate_a = one_step(head, eval_feats, paths, prompt_len)
    runs_e, hits_e = eagle_runs(head, eval_feats, paths, prompt_len, args.max_draft)
    eagle = {"one_step_agreement": rate_a, **floor_figures(runs_e, hits_e, first=1)}
    eagle["first_verify_is_prefill"] = True
    eagle["tokens_per_verify_after_prefill_k16"] = (runs_e.shape[1] - 1) / (
        eagle["speculative_floor_k16"]["verifies_per_request"] - 1
    )
    eagle_eval_s = time.perf_counter() - eval_began
    print(f"eagle: {rounded(eagle)}", file=sys.stderr, flush=True)

    # (c): the layer-skip draft, the same simulation
    layer_skip: dict[str, Any] = {"folder": str(args.draft)}
    if (args.draft / "config.json").is_file():
        draft = load_causal_lm(args.draft).eval()
        layer_skip["teacher_forced_agreement"] = path_agreement(draft, paths, prompt_len)
        runs_l, hits_l = layer_skip_runs(draft, paths, prompt_len, args.max_draft)
        layer_skip.update(floor_figures(runs_l, hits_l, first=0))
        layer_skip["layers"] = int(draft.config.num_hidden_layers)
        print(f"layer-skip: {rounded(layer_skip)}", file=sys.stderr, flush=True)

    units = " / feature std" if args.std_units else ""
    width = int(target.config.hidden_size)
    head_cost = draft_cost(target.config, 1, len(ids_np))
    head_macs = head_cost["draft_macs_per_token"] + 2 * width * width
    skip_cost = draft_cost(target.config, layer_skip.get("layers", 3), len(ids_np))
    result = {
        "target": str(args.target),
        "smoke": args.smoke,
        "torch_threads": torch.get_num_threads(),
        "bf16_autocast": bf16_is_fast(torch.device("cpu")),
        "feature": "pre-norm output of the target's last decoder layer (forward hook)",
        "hidden_states_last_in_this_transformers": hidden_states_last,
        "feature_std": feat_std,
        "loss": f"smooth_l1(g{units}, f_next{units}) + {args.cls_weight} * CE(head logits, "
        "target softmax over restricted rows)",
        "noise": f"U(-{NOISE}, {NOISE}) x feature std on input features",
        "restricted_vocab": len(ids_np),
        "restricted_vocab_heldout_coverage": coverage,
        "head_parameters_trained": sum(p.numel() for p in trainable),
        "lr": args.lr,
        "batch": args.batch,
        "context": args.context,
        "steps": step,
        "training_tokens": step * args.batch * args.context,
        "train_seconds": train_s,
        "s_per_step": train_s / max(step, 1),
        "setup_seconds": setup_s,
        "eagle_eval_seconds": eagle_eval_s,
        "load_start": load_start,
        "load_end_training": load_end_train,
        "load_end": loadavg(),
        "eval": {
            "prompts": len(prompts),
            "prompt_tokens": prompt_len,
            "new_tokens": args.new_tokens,
            "positions": len(prompts) * args.new_tokens,
        },
        "curve": curve,
        "eagle": eagle,
        "layer_skip": layer_skip,
        "cost_macs_per_token": {
            "eagle_head": head_macs,
            "eagle_relative_to_target": head_macs / head_cost["target_macs_per_token"],
            "layer_skip": skip_cost["draft_macs_per_token"],
            "layer_skip_relative_to_target": skip_cost["relative"],
            "target": head_cost["target_macs_per_token"],
            "note": "weights only (attention over the context not counted), as draft_cost",
        },
    }
    write_result(args.out, rounded(result))


if __name__ == "__main__":
    main()
