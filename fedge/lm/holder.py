"""Per-worker-process cache: the frozen base model with its LoRA wrapper, and the partitioned corpus.

Flower's Ray backend keeps ClientApp actors alive across rounds, and this module is
imported (not pickled by value), so these module-level caches survive from call to
call: the base model is loaded once per process and per client only the adapter
values and the optimizer state change. ``STATS`` counts loads and calls so tests
and benchmarks can verify the cache hits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedge import keys
from fedge.data import FederatedCorpus, build_federated_corpus
from fedge.lm.config import TrainConfig
from fedge.types import Arrays, ConfigValue

STATS = {"model_loads": 0, "calls": 0, "corpus_loads": 0}
_MODELS: dict[tuple[object, ...], LoraModel] = {}
_CORPORA: dict[tuple[object, ...], FederatedCorpus] = {}
_RESOLVED: dict[str, str] = {}
_MAX_MODELS = 2  # distinct LoRA configs kept per process


@dataclass
class LoraModel:
    """A peft-wrapped causal LM and its trainable adapter tensors by name."""

    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    device: torch.device
    initial: Arrays  # the seeded LoRA initialisation, kept because params are overwritten in place


def pick_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def configure_threads(requested: int) -> None:
    """Set torch's intra-op threads: the request, or cores / concurrent clients (env FEDGE_CONCURRENCY)."""
    if requested <= 0:
        concurrency = max(1, int(os.environ.get("FEDGE_CONCURRENCY", "1")))
        requested = max(1, (os.cpu_count() or 1) // concurrency)
    if torch.get_num_threads() != requested:
        torch.set_num_threads(requested)


def resolve_model(ref: str) -> str:
    """Turn "zoo:<preset>" into the zoo's target directory (once per process); pass others through."""
    if ref not in _RESOLVED:
        if ref.startswith("zoo:"):
            from fedge.zoo import ensure_zoo

            _RESOLVED[ref] = str(ensure_zoo(ref.removeprefix("zoo:")).target_dir)
        else:
            _RESOLVED[ref] = ref
    return _RESOLVED[ref]


def client_model_ref(config: Mapping[str, ConfigValue]) -> str:
    """The model a client loads: the server's resolved ``model-path`` if it exists here, else ``model``."""
    path = str(config.get(keys.CFG_MODEL_PATH, ""))
    if path and Path(path).is_dir():
        return path
    return str(config.get(keys.CFG_MODEL, "zoo:micro"))


def get_lora_model(ref: str, cfg: TrainConfig, device: torch.device | None = None) -> LoraModel:
    """Return the cached peft model for (model, LoRA config), loading the base only on a miss.

    The LoRA initialisation is seeded (torch seed 0) so every process builds the same
    starting adapter; in a federation the server's adapter overwrites it anyway.
    """
    from peft import LoraConfig, get_peft_model

    from fedge.lm.targets import lora_targets
    from fedge.models import load_causal_lm

    device = device or pick_device()
    path = resolve_model(ref)
    cache_key = (
        path,
        cfg.lora_r,
        cfg.lora_alpha,
        cfg.lora_dropout,
        cfg.lora_target_modules,
        str(device),
    )
    if cache_key not in _MODELS:
        if len(_MODELS) >= _MAX_MODELS:
            _MODELS.pop(next(iter(_MODELS)))
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per client process and call is noise in run logs
        base = load_causal_lm(path)
        STATS["model_loads"] += 1
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=lora_targets(cfg.lora_target_modules, base.config.model_type),
            bias="none",
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = get_peft_model(base, lora).to(device)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not params:
            raise ValueError(
                f"lora-target-modules {cfg.lora_target_modules!r} matched no module of {path}; "
                "name modules that exist (e.g. q_proj,v_proj for Llama), or use 'auto'"
            )
        initial = {n: p.detach().to("cpu", torch.float32).numpy().copy() for n, p in params.items()}
        _MODELS[cache_key] = LoraModel(model, params, device, initial)
    return _MODELS[cache_key]


def drop_models() -> None:
    """Forget every cached model (the reference ClientApp of the throughput benchmark does this)."""
    _MODELS.clear()


def set_adapter(lm: LoraModel, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy adapter values into the model in place (the base stays untouched).

    A tensor the model does not have is refused, not ignored: an ignored extra would make
    one model two (the once-per-model digest covers every array a message carries)."""
    missing = sorted(set(lm.params) - set(arrays))
    if missing:
        raise ValueError(f"adapter is missing {len(missing)} tensor(s), e.g. {missing[0]!r}")
    extra = sorted(set(arrays) - set(lm.params))
    if extra:
        raise ValueError(f"adapter has {len(extra)} tensor(s) the model lacks, e.g. {extra[0]!r}")
    with torch.no_grad():
        for name, p in lm.params.items():
            p.copy_(torch.from_numpy(np.asarray(arrays[name])).to(p.device, p.dtype))


def adapter_arrays(lm: LoraModel) -> Arrays:
    """Return the current adapter values as float32 numpy arrays."""
    return {n: p.detach().to("cpu", torch.float32).numpy().copy() for n, p in lm.params.items()}


def get_corpus(config: Mapping[str, ConfigValue]) -> FederatedCorpus:
    """Return the partitioned corpus the config describes (built or reused once per process)."""
    tokenizer_dir = resolve_model(client_model_ref(config))
    num = int(config.get(keys.CFG_NUM_PARTITIONS, 0))
    max_chars = int(config.get(keys.CFG_MAX_CHARS_PER_CLIENT, 0))
    source = str(config.get(keys.CFG_DATA_SOURCE, ""))
    if str(config.get(keys.CFG_DATA_KIND, "text")) == "instructions":
        return _instruction_corpus(tokenizer_dir, int(config.get(keys.CFG_SEQ_LEN, 128)), max_chars)
    cache_key = (
        tokenizer_dir,
        str(config.get(keys.CFG_PARTITION_SCHEME, "natural")),
        num,
        float(config.get(keys.CFG_DIRICHLET_ALPHA, 0.5)),
        int(config.get(keys.CFG_SEED, 0)),
        source,
        max_chars,
    )
    if cache_key not in _CORPORA and (known := _indexed_corpus(cache_key)) is not None:
        _CORPORA[cache_key] = known
    if cache_key not in _CORPORA:
        _CORPORA[cache_key] = build_federated_corpus(
            tokenizer_dir,
            scheme=str(cache_key[1]),
            num_partitions=num or None,
            alpha=float(cache_key[3]),  # type: ignore[arg-type]
            seed=int(cache_key[4]),  # type: ignore[call-overload]
            source=source or None,
            max_chars_per_client=max_chars or None,
        )
        STATS["corpus_loads"] += 1
        _remember_corpus(cache_key, _CORPORA[cache_key])
    return _CORPORA[cache_key]


def _instruction_corpus(tokenizer_dir: str, slot: int, max_chars: int) -> FederatedCorpus:
    """The code-instruction corpus (`fedge.data.instructions`), one example per `slot` tokens."""
    from fedge.data.instructions import build_instruction_corpus

    cache_key = (tokenizer_dir, "instructions", slot, max_chars)
    if cache_key not in _CORPORA:
        _CORPORA[cache_key] = build_instruction_corpus(tokenizer_dir, slot, max_chars or None)
        STATS["corpus_loads"] += 1
    return _CORPORA[cache_key]


def _index_file() -> Path:
    from fedge.paths import corpus_cache_dir

    return corpus_cache_dir() / "fedge-federation-index.json"


def _index_key(cache_key: tuple[object, ...]) -> str:
    """The index key: the config plus the tokenizer file's mtime (a rebuilt zoo invalidates it)."""
    import json

    tok = Path(str(cache_key[0])) / "tokenizer.json"
    stamp = tok.stat().st_mtime_ns if tok.is_file() else 0
    return json.dumps([*cache_key, stamp])


def _indexed_corpus(cache_key: tuple[object, ...]) -> FederatedCorpus | None:
    """Open a corpus this machine already built for the same config, skipping re-reading sources.

    Under the Deployment Engine every message runs in a fresh process, where
    rebuilding the cache key means reading and tokenizing the whole source again.
    """
    import json

    try:
        index = json.loads(_index_file().read_text())
        directory = Path(index[_index_key(cache_key)])
        return FederatedCorpus(directory) if (directory / "clients.json").is_file() else None
    except (OSError, ValueError, KeyError):
        return None


def _remember_corpus(cache_key: tuple[object, ...], corpus: FederatedCorpus) -> None:
    """Record where the corpus for this config lives (best effort, atomic replace)."""
    import json

    path = _index_file()
    try:
        index = json.loads(path.read_text()) if path.is_file() else {}
        index[_index_key(cache_key)] = str(corpus.directory)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index, indent=1))
        tmp.replace(path)
    except (OSError, ValueError):
        return
