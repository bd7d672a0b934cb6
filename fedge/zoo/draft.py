"""A draft for any target: its first and last layers, a restricted vocabulary, distilled on its own outputs.

`build_draft(target_dir, out)` makes a small model that proposes tokens for greedy speculative
decoding with a pretrained target whose tokenizer fedge did not train:

- **Initialised from the target** (layer skip): the same architecture and width with its
  first K layers and its last L layers (`layers`, `last_layers`; the last layers turn a late
  hidden state into the next-token prediction, so distillation has to bridge only the skipped
  middle), token embedding (frozen) and final norm copied. The draft's cost per token against
  the target's (multiply-adds, restricted head against full head) is in the card (`cost`).
- **A restricted vocabulary**: the N tokens used most often on fedge's stdlib training split
  (tokenized by the target's tokenizer) plus the special tokens. Distillation and agreement
  compute logits for those N rows only (the 49k-token head is ~80% of a 2-layer SmolLM2
  draft's compute). The saved folder is a plain model of the target's class with a full,
  untied output layer: the N rows trained, every other row one constant vector chosen so its
  logit lies far below the best restricted logit (see `_exclusion_row`). So the draft still
  presents the target's whole vocabulary, `AutoModelForCausalLM.from_pretrained` loads it
  without custom code, and the edge decoder, ONNX export and verifier are unchanged.
  Greedy verification stays lossless whatever the draft proposes: the target decides.
- **Distilled on what is measured**: agreement is taken along the target's greedy paths, so
  part of every batch (`greedy_share`) is the target's own greedy continuations of stdlib
  training prompts (sequence-level KD, Kim & Rush 2016): generated once with a KV-cached
  batched generate, cached in chunks with the target's top-k log-probs over the restricted rows
  at each generated position, and trained on with cross-entropy to that distribution (KL up to
  a constant). The rest of the batch is stdlib training windows with the zoo's loss
  (`distillation_loss`: KL to the target over the restricted rows, computed live). Windows
  and prompts start with BOS where the tokenizer adds BOS.
- **Resumable with a wall-time budget**: the greedy chunks, the trainable tensors, optimizer
  state, step and the agreement curve are kept in `<out>/.draft-build`; a later `--resume`
  run continues (generation too). The learning rate decays (cosine) over the run's time
  budget or `steps`, whichever ends first, so a build cut by its clock ends on a low rate.
  Greedy agreement with the target on held-out prompts is measured every `eval_every` steps
  (the agreement-vs-build-time curve in the card).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList

from fedge.lm.bos import bos_token_id, cut_windows, with_bos
from fedge.lm.evaluate import bf16_is_fast
from fedge.manifest import write_manifest
from fedge.zoo.presets import DRAFT_MINUTES, DraftSpec
from fedge.zoo.training import (
    _make_optimizer,
    autocast_context,
    distillation_loss,
    lr_at,
)

WORK_DIR = ".draft-build"  # hidden: the folder's manifest does not hash build state
CARD_NAME = "draft_card.json"
VOCAB_NAME = "restricted_vocab.json"
EXCLUSION_MARGIN = 30.0  # excluded tokens' logit at least this far below the best restricted one
EXCLUSION_REFINE_STEPS = 500  # perceptron steps on the shared direction (see _exclusion_row)
EXCLUSION_MIN_COSINE = 0.1  # stop once every calibration state is this far on the right side

ProgressFn = Callable[[dict[str, Any]], None]


class RestrictedLogits(nn.Module):
    """A causal LM's logits for the restricted token ids only: (B, T, N), column j = ids[j].

    `rows` are the output-layer rows of those ids (a trainable parameter for the draft, the
    target's own rows for the teacher); the model's full head is never computed.
    """

    def __init__(self, model: nn.Module, ids: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("ids", ids, persistent=False)
        self.rows = rows if isinstance(rows, nn.Parameter) else nn.Parameter(rows, False)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        base: Any = self.model.base_model  # type: ignore[union-attr]
        out: torch.Tensor = base(input_ids=input_ids).last_hidden_state
        return out

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits = self.hidden(input_ids) @ self.rows.T
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return SimpleNamespace(logits=logits)


# ---------------------------------------------------------------- data and vocabulary
def token_streams(tokenizer: Any, max_chars_per_label: int) -> tuple[np.ndarray, np.ndarray]:
    """fedge's stdlib train and held-out splits as streams of the target's tokens (EOS between)."""
    from fedge.data.corpus import split_sources, stdlib_sources

    train_files, heldout_files = split_sources(
        stdlib_sources(max_chars_per_label=max_chars_per_label)
    )
    eos = tokenizer.eos_token_id
    streams = []
    for files in (train_files, heldout_files):
        encoded = tokenizer([f.text for f in files], add_special_tokens=False)["input_ids"]
        streams.append(np.fromiter((t for ids in encoded for t in [*ids, eos]), dtype=np.uint32))
    return streams[0], streams[1]


def restricted_vocabulary(
    train: np.ndarray, vocab_size: int, n: int, always: list[int]
) -> np.ndarray:
    """The `n` most frequent ids of `train` plus `always` (special tokens), sorted."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")
    chosen = [int(t) for t in order[:n] if counts[t] > 0]
    return np.array(
        sorted(set(chosen) | {t for t in always if 0 <= t < vocab_size}), dtype=np.int64
    )


# ---------------------------------------------------------------- the model
def draft_layers(total: int, first: int, last: int) -> list[int]:
    """The target layers a draft copies: its first `first` and its last `last`, in order."""
    if first < 1 or last < 0 or first + last >= total:
        raise ValueError(
            f"a draft of the first {first} and last {last} layers needs first >= 1, last >= 0 "
            f"and first + last < {total} (the target's layers)"
        )
    return [*range(first), *range(total - last, total)]


def init_draft(target: Any, layers: int, last_layers: int = 0) -> Any:
    """A model of the target's class with its first `layers` and last `last_layers` layers.

    The embedding and final norm are the target's; the output layer is untied (its rows are
    set at save time); the embedding is frozen. The last layers turn a late hidden state into
    the next-token prediction, so distillation only has to bridge the skipped middle.
    """
    from transformers import AutoModelForCausalLM

    cfg: Any = target.config.__class__.from_dict(target.config.to_dict())
    chosen = draft_layers(int(cfg.num_hidden_layers), layers, last_layers)
    cfg.num_hidden_layers = len(chosen)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = [cfg.layer_types[i] for i in chosen]
    cfg.tie_word_embeddings = False
    draft: Any = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    source = target.state_dict()
    copied = {}
    for key, tensor in draft.state_dict().items():
        name = _source_name(key, chosen)
        if name in source and source[name].shape == tensor.shape:
            copied[key] = source[name]
    head: Any = target.get_output_embeddings()
    copied["lm_head.weight"] = head.weight.detach()
    missing, _ = draft.load_state_dict(copied, strict=False)
    if missing:
        raise ValueError(f"draft tensors not found in the target: {missing[:5]}")
    draft.get_input_embeddings().weight.requires_grad_(False)  # type: ignore[union-attr]
    draft.get_output_embeddings().weight.requires_grad_(False)  # type: ignore[union-attr]
    return draft


def _source_name(key: str, chosen: list[int]) -> str:
    """The target's name of draft tensor `key`: draft layer i is target layer chosen[i]."""
    parts = key.split(".")
    for at in range(len(parts) - 1):
        if parts[at] == "layers" and parts[at + 1].isdigit():
            parts[at + 1] = str(chosen[int(parts[at + 1])])
            break
    return ".".join(parts)


@torch.no_grad()
def _exclusion_row(
    student: RestrictedLogits, windows: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """One row for every excluded token: -alpha * (a direction all final hidden states share).

    A decoder's normed final states share a strong common direction, so a row against it gives
    every position a low logit. The direction starts as their mean and is then pushed towards
    the states it projects worst on (perceptron steps: a state on the wrong side would let
    the excluded tokens win there). alpha puts that logit EXCLUSION_MARGIN below the best
    restricted logit at every calibration position where the direction is positive.
    """
    hidden = student.hidden(windows).float().reshape(-1, student.rows.shape[1])
    best = (hidden @ student.rows.float().T).max(-1).values
    unit = hidden / hidden.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    direction = unit.mean(0)
    direction = direction / direction.norm().clamp_min(1e-12)
    for _ in range(EXCLUSION_REFINE_STEPS):
        worst = unit[(unit @ direction).argmin()]
        if float(worst @ direction) > EXCLUSION_MIN_COSINE:
            break
        direction = direction + 0.1 * worst
        direction = direction / direction.norm().clamp_min(1e-12)
    projection = hidden @ direction
    positive = projection > 0
    alpha = float(((EXCLUSION_MARGIN - best[positive]) / projection[positive]).max().clamp_min(0))
    return -alpha * direction, {
        "alpha": round(alpha, 3),
        "calibration_positions": int(hidden.shape[0]),
        "positions_direction_positive": round(float(positive.float().mean()), 4),
        "min_cosine": round(float((unit @ direction).min()), 4),
    }


# ---------------------------------------------------------------- agreement
def spaced_prompts(stream: np.ndarray, count: int, tokens: int, bos: int | None) -> torch.Tensor:
    """`count` prompts of `tokens` tokens spaced evenly through `stream` (BOS first where used)."""
    stride = max(1, (len(stream) - tokens) // count)
    rows = [with_bos(stream[i * stride : i * stride + tokens], bos) for i in range(count)]
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def target_paths(target: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The target's greedy continuation of each (equal-length) prompt, one batched generate."""
    out: torch.Tensor = target.generate(  # type: ignore[operator]
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out


@torch.no_grad()
def path_agreement(
    draft: Callable[..., Any], paths: torch.Tensor, prompt_len: int, ids: torch.Tensor | None = None
) -> float:
    """Teacher-forced greedy agreement of `draft` on the target's paths (restricted columns -> ids)."""
    logits = draft(input_ids=paths[:, :-1]).logits[:, prompt_len - 1 :]
    choice = logits.argmax(-1)
    if ids is not None:
        choice = ids[choice]
    return float((choice == paths[:, prompt_len:]).float().mean())


# ---------------------------------------------------------------- the build
def build_draft(
    target_dir: Path,
    out: Path,
    spec: DraftSpec | None = None,
    minutes: float = DRAFT_MINUTES,
    resume: bool = False,
    progress: ProgressFn | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Build (or continue) a draft for the target at `target_dir` into `out`; return its card.

    Training stops at the end of the schedule, when `minutes` have passed in this run, or
    after `stop_after` steps in this run; a `resume` run continues from the checkpoint.
    """
    from fedge.models import load_causal_lm, load_tokenizer

    spec = spec or DraftSpec()
    work = out / WORK_DIR
    spec_path, checkpoint = work / "spec.json", work / "checkpoint.pt"
    if resume and spec_path.is_file():
        built = json.loads(spec_path.read_text())
        wanted = asdict(spec)
        changed = {
            k: (built.get(k), wanted.get(k))
            for k in {*built, *wanted}
            if built.get(k) != wanted.get(k)
        }
        if changed:
            raise ValueError(
                f"cannot resume {out}: settings differ from the build's {changed} (as (build, "
                f"now)); build with the build's settings, or delete {work} to start afresh"
            )
    elif work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(asdict(spec)))
    load_before = os.getloadavg()[0]
    torch.manual_seed(spec.seed)

    tokenizer = load_tokenizer(target_dir)
    bos = bos_token_id(tokenizer)
    target: Any = load_causal_lm(target_dir)
    target.requires_grad_(False)
    vocab_size = int(target.get_output_embeddings().weight.shape[0])  # type: ignore[union-attr]
    train, heldout = _cached_streams(work, tokenizer, spec.max_chars_per_label)
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id]
    ids_np = restricted_vocabulary(
        train, vocab_size, spec.vocab, [t for t in specials if t is not None]
    )
    ids = torch.from_numpy(ids_np)
    coverage = float(np.isin(heldout, ids_np).mean())

    draft = init_draft(target, spec.layers, spec.last_layers)
    head: Any = target.get_output_embeddings()
    teacher = RestrictedLogits(target, ids, head.weight.detach()[ids].clone()).eval()
    student = RestrictedLogits(draft, ids, nn.Parameter(head.weight.detach()[ids].clone()))
    budget = spec.budget()
    optimizer = _make_optimizer(student, budget)
    loss_fn = distillation_loss(teacher, spec.temperature)

    paths = cached_paths(
        work / "paths.npy", target, heldout, spec.prompts, spec.prompt_tokens, spec.new_tokens, bos
    )
    generator: nn.Module | None = None  # made when the first chunk is generated (a resumed
    # build whose chunks are all cached never copies the target)
    deadline = time.perf_counter() + minutes * 60
    greedy, have = None, 0
    step, seconds, curve = 0, 0.0, []
    if resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=True)
        student.load_state_dict(state["trainable"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step, seconds, curve = int(state["step"]), float(state["seconds"]), state["curve"]
    if not curve:
        student.eval()
        curve.append(
            _point(0, 0.0, spec, path_agreement(student, paths, _prompt_len(spec, bos), ids))
        )
        _report(progress, curve[-1])

    began = time.perf_counter() - seconds
    horizon = seconds + minutes * 60  # the schedule decays over the build's whole time budget
    student.train()
    last = budget.steps if stop_after is None else min(budget.steps, step + stop_after)
    while step < last and time.perf_counter() < deadline:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, budget, (time.perf_counter() - began) / horizon)
        want = _greedy_chunks_at(step, spec)
        if want > have:  # the next chunk(s) of greedy rows: generated once, then cached
            if generator is None:
                generator = greedy_generator(target, spec.greedy_precision)
            greedy, have = _greedy_data(work, generator, train, ids, spec, bos, want, greedy), want
        rng = np.random.default_rng([spec.seed, step])
        n_greedy = round(spec.batch_size * spec.greedy_share) if greedy is not None else 0
        starts = rng.integers(0, len(train) - spec.context - 1, size=spec.batch_size - n_greedy)
        picked = rng.integers(0, greedy.rows.shape[0], size=n_greedy) if greedy else None
        with autocast_context():
            loss = torch.zeros(())
            if len(starts):
                batch = torch.from_numpy(cut_windows(train, starts, spec.context, bos))
                loss = loss + loss_fn(student, batch) * (len(starts) / spec.batch_size)
            if greedy is not None and picked is not None and n_greedy:
                loss = loss + greedy.loss(student, picked) * (n_greedy / spec.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        step += 1
        if step % spec.eval_every == 0 or step == last or time.perf_counter() >= deadline:
            student.eval()
            rate = path_agreement(student, paths, _prompt_len(spec, bos), ids)
            student.train()
            curve.append(_point(step, time.perf_counter() - began, spec, rate, loss.item()))
            _report(progress, curve[-1])
            _save_checkpoint(
                checkpoint, student, optimizer, step, time.perf_counter() - began, curve
            )
    student.eval()

    calibration = torch.from_numpy(
        cut_windows(train, np.arange(32) * (len(train) // 33), spec.context, bos)
    )
    exclusion, exclusion_figures = _exclusion_row(student, calibration)
    with torch.no_grad():
        out_head: Any = draft.get_output_embeddings()
        out_head.weight.copy_(exclusion.expand_as(out_head.weight))
        out_head.weight[ids] = student.rows.detach()
    full_rate = path_agreement(draft, paths, _prompt_len(spec, bos))
    with torch.no_grad():
        held = torch.from_numpy(
            cut_windows(heldout, np.arange(4) * (len(heldout) // 5), spec.context, bos)
        )
        choice = draft(input_ids=held).logits.argmax(-1)
        excluded_wins = float((~torch.isin(choice, ids)).float().mean())
    _save_folder(draft, tokenizer, out, ids_np)
    card = {
        "target": str(Path(target_dir).resolve()),
        "architecture": type(draft).__name__,
        "spec": asdict(spec),
        "bos_first": bos is not None,
        "parameters": sum(p.numel() for p in draft.parameters()),
        "trained_parameters": sum(p.numel() for p in student.parameters() if p.requires_grad),
        "restricted_vocab": {
            "size": len(ids_np),
            "of": vocab_size,
            "heldout_token_coverage": round(coverage, 4),
            "file": VOCAB_NAME,
        },
        "excluded_rows": {
            **exclusion_figures,
            "heldout_argmax_outside_restricted": round(excluded_wins, 4),
        },
        "layers": {
            "target_layers": draft_layers(
                int(target.config.num_hidden_layers), spec.layers, spec.last_layers
            ),
            "of": int(target.config.num_hidden_layers),
        },
        "cost": draft_cost(target.config, spec.layers + spec.last_layers, len(ids_np)),
        "data": {
            "train_tokens": len(train),
            "heldout_tokens": len(heldout),
            "greedy_rows": 0 if greedy is None else int(greedy.rows.shape[0]),
            "greedy_precision": str(greedy_dtype(target, spec.greedy_precision)).removeprefix(
                "torch."
            ),
            "greedy_tokens": 0
            if greedy is None
            else int(greedy.values.shape[0] * spec.greedy_tokens),
        },
        "steps": step,
        "training_tokens": step * spec.batch_size * spec.context,
        "training_seconds": round(time.perf_counter() - began, 1),
        "agreement_curve": curve,
        "greedy_agreement": round(full_rate, 4),
        "agreement_prompts": int(paths.shape[0]),
        "agreement_positions": int(paths.shape[0] * spec.new_tokens),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    (out / CARD_NAME).write_text(json.dumps(card, indent=2))
    write_manifest(out, {"fedge_draft_for": card["target"]})
    return card


def draft_target(draft_dir: Path) -> Path | None:
    """The target a draft built here was distilled from (its card's `target`), if still there."""
    card = Path(draft_dir) / CARD_NAME
    if not card.is_file():
        return None
    target = Path(json.loads(card.read_text())["target"])
    return target if target.is_dir() else None


def _prompt_len(spec: DraftSpec, bos: int | None) -> int:
    return spec.prompt_tokens + (1 if bos is not None else 0)


def _point(
    step: int, seconds: float, spec: DraftSpec, rate: float, loss: float = math.nan
) -> dict[str, Any]:
    return {
        "step": step,
        "seconds": round(seconds, 1),
        "tokens": step * spec.batch_size * spec.context,
        "greedy_agreement": round(rate, 4),
        "loss": None if math.isnan(loss) else round(loss, 4),
    }


def _report(progress: ProgressFn | None, point: dict[str, Any]) -> None:
    if progress is not None:
        progress(point)


def _cached_streams(work: Path, tokenizer: Any, max_chars: int) -> tuple[np.ndarray, np.ndarray]:
    train_path, heldout_path = work / "train.npy", work / "heldout.npy"
    if not (train_path.is_file() and heldout_path.is_file()):
        train, heldout = token_streams(tokenizer, max_chars)
        np.save(train_path, train)
        np.save(heldout_path, heldout)
    return np.load(train_path), np.load(heldout_path)


def cached_paths(
    path: Path,
    target: nn.Module,
    stream: np.ndarray,
    count: int,
    prompt_tokens: int,
    new_tokens: int,
    bos: int | None,
) -> torch.Tensor:
    """The target's greedy paths after `count` prompts spaced through `stream` (BOS first where
    the tokenizer adds it), generated once and kept at `path`."""
    if not path.is_file():
        prompts = spaced_prompts(stream, count, prompt_tokens, bos)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, target_paths(target, prompts, new_tokens).numpy())
    return torch.from_numpy(np.load(path).astype(np.int64))


class _TopK(LogitsProcessor):
    """Records the top-k log-probs over the restricted rows at each generated position."""

    def __init__(self, ids: torch.Tensor, k: int) -> None:
        self.ids, self.k = ids, min(k, len(ids))
        self.values: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        values, indices = scores[:, self.ids].float().log_softmax(-1).topk(self.k, -1)
        self.values.append(values.half())
        self.indices.append(indices.int())
        return scores  # greedy decoding itself is untouched


@dataclass
class GreedyData:
    """Sequence-level KD rows: a prompt, the target's greedy continuation, its top-k log-probs.

    `values`/`indices` (rows, greedy_tokens, k) are the target's log-probs over the restricted
    rows (indices into them) at each generated position; the prompt is `prompt_len` tokens.
    """

    rows: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    prompt_len: int

    def __bool__(self) -> bool:
        return bool(self.rows.shape[0])

    def loss(self, student: nn.Module, picked: np.ndarray) -> torch.Tensor:
        """Cross-entropy to the target's top-k distribution (KL up to a constant) on generated positions."""
        at = torch.from_numpy(picked)
        rows = self.rows[at].long()
        logits = student(input_ids=rows[:, :-1]).logits[:, self.prompt_len - 1 :].float()
        chosen = logits.log_softmax(-1).gather(-1, self.indices[at].long())
        return -(self.values[at].float().exp() * chosen).sum(-1).mean()


def greedy_dtype(target: nn.Module, precision: str) -> torch.dtype:
    """The dtype the greedy rows are generated in: bf16 for "bf16" (or "auto" on a CPU or GPU
    that runs bf16 fast), else the target's own."""
    device = next(target.parameters()).device
    if precision == "bf16" or (precision == "auto" and bf16_is_fast(device)):
        return torch.bfloat16
    return next(target.parameters()).dtype


def greedy_generator(target: nn.Module, precision: str) -> nn.Module:
    """The model that generates the greedy rows: a bf16 copy of `target` where `greedy_dtype`
    says bf16, else `target` itself. Generation is a third of a build's time, and bf16 weights
    run it 1.5x faster than fp32 on SmolLM2 (2 cores)."""
    dtype = greedy_dtype(target, precision)
    if dtype == next(target.parameters()).dtype:
        return target
    return copy.deepcopy(target).to(dtype).eval()


def _greedy_chunks_at(step: int, spec: DraftSpec) -> int:
    """How many greedy chunks training step `step` draws from (one more every `greedy_every`)."""
    total = math.ceil(spec.greedy_rows / spec.greedy_batch)
    return min(total, step // spec.greedy_every + 1)


def _greedy_data(
    work: Path,
    generator: Any,
    train: np.ndarray,
    ids: torch.Tensor,
    spec: DraftSpec,
    bos: int | None,
    count: int,
    have: GreedyData | None = None,
) -> GreedyData | None:
    """The first `count` chunks of the target's greedy continuations of train-split prompts,
    generated by `generator` (the target, or its bf16 copy: see `greedy_generator`).

    A chunk is `greedy_batch` rows from one batched, KV-cached generate, saved in `work` as it
    completes and read back afterwards, so a resumed build draws from the same rows at the
    same steps. Chunks already in `have` are kept, not read again (a build adds a chunk every
    `greedy_every` steps). None when the spec asks for no greedy rows.
    """
    if spec.greedy_rows == 0 or count == 0:
        return None
    held = 0 if have is None else math.ceil(have.rows.shape[0] / spec.greedy_batch)
    chunks = (
        []
        if have is None
        else [{"rows": have.rows, "values": have.values, "indices": have.indices}]
    )
    for chunk in range(held, count):
        path = work / f"greedy-{chunk:03d}.pt"
        if not path.is_file():
            rows_here = min(spec.greedy_batch, spec.greedy_rows - chunk * spec.greedy_batch)
            rng = np.random.default_rng([spec.seed, 1, chunk])  # not the training steps' stream
            starts = rng.integers(0, len(train) - spec.greedy_prompt_tokens, size=rows_here)
            prompts = torch.tensor(
                [with_bos(train[s : s + spec.greedy_prompt_tokens], bos) for s in starts],
                dtype=torch.long,
            )
            recorder = _TopK(ids, spec.top_k)
            rows = generator.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=spec.greedy_tokens,
                min_new_tokens=spec.greedy_tokens,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([recorder]),
            )
            state = {
                "rows": rows.int(),
                "values": torch.stack(recorder.values, 1),
                "indices": torch.stack(recorder.indices, 1),
            }
            partial = path.with_suffix(".partial")
            torch.save(state, partial)
            partial.replace(path)
        chunks.append(torch.load(path, weights_only=True))
    return GreedyData(
        torch.cat([c["rows"] for c in chunks]),
        torch.cat([c["values"] for c in chunks]),
        torch.cat([c["indices"] for c in chunks]),
        _prompt_len(replace(spec, prompt_tokens=spec.greedy_prompt_tokens), bos),
    )


def draft_cost(config: Any, layers: int, vocab: int) -> dict[str, Any]:
    """Multiply-adds per token of the draft (restricted head) against the target (full head).

    c = draft / target is the draft's cost per proposed token in units of a target token,
    the `c` of the speculative estimate E[tokens per verify] / (gamma * c + verify).
    """
    width, inner = int(config.hidden_size), int(config.intermediate_size)
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or width // heads)
    per_layer = width * head_dim * (2 * heads + 2 * kv) + 3 * width * inner
    draft = layers * per_layer + vocab * width
    target = int(config.num_hidden_layers) * per_layer + int(config.vocab_size) * width
    return {
        "draft_macs_per_token": draft,
        "target_macs_per_token": target,
        "relative": round(draft / target, 4),
    }


def _save_checkpoint(
    path: Path,
    student: RestrictedLogits,
    optimizer: torch.optim.Optimizer,
    step: int,
    seconds: float,
    curve: list[dict[str, Any]],
) -> None:
    """Trainable tensors only (the frozen embedding is the target's), written atomically."""
    trainable = {k: v for k, v in student.named_parameters() if v.requires_grad}
    state = {
        "trainable": {k: v.detach() for k, v in trainable.items()},
        "optimizer": optimizer.state_dict(),
        "step": step,
        "seconds": seconds,
        "curve": curve,
    }
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)


def _save_folder(draft: nn.Module, tokenizer: Any, out: Path, ids: np.ndarray) -> None:
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    draft.save_pretrained(out)  # type: ignore[operator]
    tokenizer.save_pretrained(out)
    (out / VOCAB_NAME).write_text(json.dumps([int(t) for t in ids]))
