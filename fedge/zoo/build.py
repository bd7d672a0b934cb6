"""Build the built-in zoo: tokenizer, target LM and a draft distilled to agree with it.

Stages leave their results under `<root>/.build`, so an interrupted build resumes where it stopped;
the finished model directories carry manifests, so a partial or corrupted copy is rebuilt, never used.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fedge.data.corpus import SourceFile, split_sources, stdlib_sources
from fedge.manifest import require_intact, verify_manifest, write_manifest
from fedge.paths import zoo_dir
from fedge.zoo.evaluate import greedy_agreement, perplexity, prompts_from
from fedge.zoo.presets import ModelShape, ZooPreset, get_preset
from fedge.zoo.tokenizer import save_tokenizer, train_tokenizer
from fedge.zoo.training import (
    LossFn,
    TrainResult,
    compile_module,
    distillation_loss,
    next_token_loss,
    share_embeddings,
    shared_parameters,
    train,
)

CARD_NAME = "model_card.json"
RUN_RECORD = "training.json"  # inside each model directory, so an intact model is reused as is
TIMINGS_NAME = "timings.json"  # wall-clock figures stay outside the hashed model directories
PROMPT_TOKENS = 32  # prompt length for the agreement measurement


@dataclass(frozen=True)
class ZooPaths:
    """Where a built zoo lies: two standard Hugging Face model directories and a card."""

    root: Path

    @property
    def target_dir(self) -> Path:
        return self.root / "target"

    @property
    def draft_dir(self) -> Path:
        return self.root / "draft"

    @property
    def card_path(self) -> Path:
        return self.root / CARD_NAME

    @property
    def card(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.card_path.read_text())
        return loaded


def zoo_problems(paths: ZooPaths) -> list[str]:
    """Why `paths` is not a complete, intact zoo (empty list: it is)."""
    if not paths.card_path.is_file():
        return [f"{paths.card_path} is missing (the build did not finish)"]
    return verify_manifest(paths.target_dir) + verify_manifest(paths.draft_dir)


def _settings(
    paths: ZooPaths, preset: ZooPreset
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The built card's preset settings, the code's, and the fields the card has that differ."""
    built = paths.card.get("preset_config", {})
    current = json.loads(json.dumps(asdict(preset)))
    return built, current, [k for k in built if built[k] != current.get(k)]


def stale_settings(paths: ZooPaths, preset: ZooPreset) -> list[str]:
    """Preset settings that differ between the built card and the code (fields the card has)."""
    built, current, changed = _settings(paths, preset)
    return [f"{k}: built {built[k]!r}, now {current[k]!r}" for k in changed]


# Preset fields only the draft stage (and the card) depends on: the target, its tokenizer and
# its token streams are built from the other fields alone.
DRAFT_FIELDS = frozenset(
    {"draft", "draft_train", "distill_temperature", "share_embeddings"}
    | {"eval_windows", "agreement_prompts", "agreement_tokens"}
)


def draft_only(paths: ZooPaths, preset: ZooPreset) -> bool:
    """Whether the built zoo differs from `preset` only in draft fields (see `DRAFT_FIELDS`)."""
    _, _, changed = _settings(paths, preset)
    return bool(changed) and set(changed) <= DRAFT_FIELDS


def _keep_target_only(paths: ZooPaths) -> None:
    """Drop the draft and the card; seed the build folder with the target's own tokenizer, so
    the resumed build reuses the target and retrains only the draft."""
    shutil.rmtree(paths.draft_dir, ignore_errors=True)
    paths.card_path.unlink()
    tokenizer = paths.root / ".build" / "tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (paths.target_dir / name).is_file():
            shutil.copy2(paths.target_dir / name, tokenizer / name)


def ensure_zoo(preset: str = "micro", root: Path | None = None, seed: int = 0) -> ZooPaths:
    """Return the zoo at `root` (default: the cache), building or repairing it when needed."""
    paths = ZooPaths(root or zoo_dir(preset))
    if zoo_problems(paths) or stale_settings(paths, get_preset(preset)):
        build_zoo(preset, paths.root, seed=seed)
    return paths


def build_zoo(
    preset_name: str,
    out: Path | None = None,
    seed: int = 0,
    force: bool = False,
    console: Console | None = None,
) -> ZooPaths:
    """Build (or resume building) a zoo preset into `out` and return its paths."""
    preset = get_preset(preset_name)
    paths = ZooPaths(out or zoo_dir(preset.name))
    console = console or Console(stderr=True)
    if force and paths.root.exists():
        shutil.rmtree(paths.root)
    problems = zoo_problems(paths)
    stale = [] if problems else stale_settings(paths, preset)
    if not problems and not stale:
        console.print(f"[green]zoo {preset.name} at {paths.root} is intact; reusing it")
        return paths
    if stale and draft_only(paths, preset):  # the target and its tokenizer stay valid
        console.print(
            f"[yellow]zoo at {paths.root} has other draft settings ({'; '.join(stale)}); "
            "rebuilding the draft on the kept target"
        )
        _keep_target_only(paths)
    elif stale:  # intact, but built with other settings: nothing of it can be reused
        console.print(f"[yellow]zoo at {paths.root} is stale ({'; '.join(stale)}); rebuilding")
        shutil.rmtree(paths.root)
    elif paths.card_path.is_file():
        console.print(f"[yellow]zoo at {paths.root} is damaged ({'; '.join(problems)}); rebuilding")
        paths.card_path.unlink()
    return _Builder(preset, paths, seed, console).run()


class _Builder:
    """One build: the stages in order, each skipped when its result already exists."""

    def __init__(self, preset: ZooPreset, paths: ZooPaths, seed: int, console: Console) -> None:
        self.preset, self.paths, self.seed, self.console = preset, paths, seed, console
        self.work = paths.root / ".build"
        self.work.mkdir(parents=True, exist_ok=True)

    def run(self) -> ZooPaths:
        started, cpu_started = time.perf_counter(), time.process_time()
        load_before = os.getloadavg()[0]
        torch.set_num_threads(self.preset.threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        files = stdlib_sources(max_chars_per_label=self.preset.max_chars_per_label)
        train_files, heldout_files = split_sources(files)
        tokenizer = self._tokenizer(files)
        train_ids = self._token_stream("train", train_files, tokenizer)
        heldout_ids = self._token_stream("heldout", heldout_files, tokenizer)
        target, target_run = self._model("target", tokenizer, self.preset.target, train_ids, None)
        draft, draft_run = self._model("draft", tokenizer, self.preset.draft, train_ids, target)
        card = self._card(
            files, tokenizer, train_ids, heldout_ids, target, draft, target_run, draft_run
        )
        card["build_seconds"] = round(time.perf_counter() - started, 1)
        card["build_cpu_seconds"] = round(time.process_time() - cpu_started, 1)
        card["build_load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        self.paths.card_path.write_text(json.dumps(card, indent=2))
        shutil.rmtree(self.work, ignore_errors=True)
        self.console.print(f"[green]zoo {self.preset.name} built at {self.paths.root}")
        return self.paths

    def _tokenizer(self, files: list[SourceFile]) -> PreTrainedTokenizerFast:
        directory = self.work / "tokenizer"
        if not (directory / "tokenizer.json").is_file():
            self.console.print(f"training a {self.preset.vocab_size}-token byte-level BPE")
            trained = train_tokenizer(
                (f.text for f in files), self.preset.vocab_size, self.preset.special_tokens
            )
            save_tokenizer(trained, directory)
        loaded: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(directory)
        return loaded

    def _token_stream(
        self, split: str, files: list[SourceFile], tokenizer: PreTrainedTokenizerFast
    ) -> np.ndarray:
        """Documents joined by the end-of-text token, cached as uint16 (every vocab fits)."""
        path = self.work / f"{split}.npy"
        if not path.is_file():
            encoded = tokenizer([f.text for f in files], add_special_tokens=False)["input_ids"]
            eos = tokenizer.eos_token_id
            stream = np.fromiter((t for ids in encoded for t in [*ids, eos]), dtype=np.uint16)
            np.save(path, stream)
        return np.load(path)

    def _model(
        self,
        role: str,
        tokenizer: PreTrainedTokenizerFast,
        shape: ModelShape,
        train_ids: np.ndarray,
        teacher: LlamaForCausalLM | None,
    ) -> tuple[LlamaForCausalLM, dict[str, Any]]:
        """Train one model (or reuse its intact directory) and save it with the tokenizer."""
        directory = self.paths.root / role
        if not verify_manifest(directory):
            model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
            run = json.loads((directory / RUN_RECORD).read_text())
            timings = self._timings()
            run["training_seconds"] = timings.get(role)
            run["training_cpu_seconds"] = timings.get(f"{role}_cpu")
            return model.eval(), run
        torch.manual_seed(self.seed + (1 if teacher is not None else 0))
        model = LlamaForCausalLM(self._config(shape, tokenizer))
        if teacher is not None and self.preset.share_embeddings:
            share_embeddings(model, teacher)
        budget = self.preset.draft_train if teacher is not None else self.preset.target_train
        loss_fn: LossFn
        if teacher is None:
            loss_fn = next_token_loss
        else:
            forward = compile_module(teacher) if self.preset.compiled else teacher
            loss_fn = distillation_loss(forward, self.preset.distill_temperature)
        with self._progress(f"{role} ({'distil' if teacher else 'pretrain'})", budget.steps) as bar:
            result = train(
                model,
                train_ids,
                budget,
                self.preset.context,
                self.seed,
                loss_fn,
                self.work / f"{role}.pt",
                self.preset.checkpoint_every,
                bar,
                compiled=self.preset.compiled,
            )
        run = _run_record(
            model, result, shared=teacher is not None and self.preset.share_embeddings
        )
        self._save(model, tokenizer, directory, run)
        timings = {
            **self._timings(),
            role: round(result.seconds, 1),
            f"{role}_cpu": round(result.cpu_seconds, 1),
        }
        (self.paths.root / TIMINGS_NAME).write_text(json.dumps(timings))
        return model, {
            **run,
            "training_seconds": timings[role],
            "training_cpu_seconds": timings[f"{role}_cpu"],
        }

    def _timings(self) -> dict[str, float]:
        path = self.paths.root / TIMINGS_NAME
        loaded: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}
        return loaded

    def _config(self, shape: ModelShape, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.heads,
            max_position_embeddings=self.preset.context * 4,
            tie_word_embeddings=True,  # small models: the embedding is most of the parameters
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

    def _save(
        self,
        model: LlamaForCausalLM,
        tokenizer: PreTrainedTokenizerFast,
        directory: Path,
        run: dict[str, Any],
    ) -> None:
        if directory.exists():
            shutil.rmtree(directory)
        model.save_pretrained(directory)
        save_tokenizer(tokenizer, directory)
        (directory / RUN_RECORD).write_text(json.dumps(run, indent=2))
        write_manifest(directory, {"fedge_zoo_preset": self.preset.name, "seed": self.seed})
        require_intact(directory)

    def _progress(self, label: str, total: int) -> _StepBar:
        return _StepBar(self.console, label, total)

    def _card(
        self,
        files: list[SourceFile],
        tokenizer: PreTrainedTokenizerFast,
        train_ids: np.ndarray,
        heldout_ids: np.ndarray,
        target: LlamaForCausalLM,
        draft: LlamaForCausalLM,
        target_run: dict[str, Any],
        draft_run: dict[str, Any],
    ) -> dict[str, Any]:
        """Measure and collect the figures of the model card."""
        p = self.preset
        target_run, draft_run = dict(target_run), dict(draft_run)
        self.console.print("evaluating held-out perplexity and draft agreement")
        with torch.no_grad():
            target_run["heldout_perplexity"] = round(
                perplexity(target, heldout_ids, p.context, p.eval_windows), 3
            )
            draft_run["heldout_perplexity"] = round(
                perplexity(draft, heldout_ids, p.context, p.eval_windows), 3
            )
            prompts = prompts_from(heldout_ids, p.agreement_prompts, PROMPT_TOKENS)
            agreement = greedy_agreement(target, draft, prompts, p.agreement_tokens)
        return {
            "preset": p.name,
            "seed": self.seed,
            "architecture": "LlamaForCausalLM",
            "corpus": {
                "source": "python standard library (tests excluded)",
                "files": len(files),
                "characters": sum(len(f.text) for f in files),
                "train_tokens": len(train_ids),
                "heldout_tokens": len(heldout_ids),
            },
            "tokenizer": {"kind": "byte-level BPE", "vocab_size": len(tokenizer)},
            "target": target_run,
            "draft": draft_run,
            "agreement": {
                "greedy_rate": round(agreement.rate, 4),
                "tokens_per_verify_draft4": round(agreement.tokens_per_verify, 3),
                "positions": agreement.positions,
                "prompts": len(prompts),
            },
            "preset_config": asdict(p),
        }


def _run_record(model: LlamaForCausalLM, result: TrainResult, shared: bool) -> dict[str, Any]:
    """Training figures; a draft sharing the target's embedding also counts its own parameters."""
    record: dict[str, Any] = {"parameters": sum(t.numel() for t in model.parameters())}
    if shared:
        record["shared_with_target"] = sum(t.numel() for t in shared_parameters(model))
        record["own_parameters"] = record["parameters"] - record["shared_with_target"]
    return {
        **record,
        "training_steps": result.steps,
        "training_tokens": result.tokens,
        "final_train_loss": round(result.final_loss, 4),
    }


class _StepBar:
    """A rich progress bar with ETA for one training stage, usable as the loop's callback."""

    def __init__(self, console: Console, label: str, total: int) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._progress.add_task(label, total=total, loss=float("nan"))

    def __enter__(self) -> _StepBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def __call__(self, step: int, total: int, loss: float) -> None:
        self._progress.update(self._task, completed=step, loss=loss)
