"""The server's copy of base + LoRA: the initial adapter, held-out perplexity and the final export."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedge.lm import holder
from fedge.lm.bos import model_bos_token_id
from fedge.lm.evaluate import evaluate_tokens
from fedge.server.config import RunConfig
from fedge.server.messages import server_config
from fedge.strategies.base import Arrays


class ServerModel:
    """The server's copy of base + LoRA: initial adapter, held-out perplexity, final export."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.model_path = holder.resolve_model(cfg.model)
        self.client_config = server_config(cfg)
        self.lm = holder.get_lora_model(self.model_path, cfg.train)
        self._heldout: dict[tuple[int, ...] | None, np.ndarray] = {}

    def initial_adapter(self) -> Arrays:
        """The seeded LoRA initialisation (B = 0, so the model starts as the base model)."""
        return {k: v.copy() for k, v in self.lm.initial.items()}

    def heldout(self, partitions: Sequence[int] | None = None) -> np.ndarray:
        """The held-out tokens of the given partitions (default: every client), built once."""
        key = tuple(partitions) if partitions is not None else None
        if key not in self._heldout:
            corpus = holder.get_corpus(self.client_config)
            if key is None:
                self._heldout[key] = np.asarray(corpus.heldout_union())
            else:
                streams = [np.asarray(corpus.client(p).heldout) for p in key]
                self._heldout[key] = np.concatenate(streams) if streams else np.zeros(0, np.int64)
        return self._heldout[key]

    def evaluate(self, adapter: Arrays, partitions: Sequence[int] | None = None) -> float:
        """Mean token loss of base + ``adapter`` on evenly spaced held-out windows.

        ``partitions`` limits the held-out data to those clients' (the participants');
        by default every client's held-out split is used (the whole corpus). NaN when the
        participants hold no held-out text (small packages can have none): nothing to score.
        """
        tokens = self.heldout(partitions)
        if partitions is not None and len(tokens) < 2:
            return math.nan
        holder.set_adapter(self.lm, adapter)
        cfg = self.cfg.train
        eval_cfg = type(cfg).from_config(
            {**cfg.to_config(), "eval-batches": self.cfg.server_eval_batches}
        )
        bos = model_bos_token_id(self.model_path)  # BOS first where the tokenizer adds it
        loss, _ = evaluate_tokens(self.lm.model, tokens, eval_cfg, self.lm.device, bos)
        return loss

    def export(self, adapter: Arrays, out: Path) -> Path:
        """Save the adapter in peft format and, if configured, a merged model with its tokenizer."""
        from peft import PeftModel

        from fedge.models import load_causal_lm, load_tokenizer

        holder.set_adapter(self.lm, adapter)
        adapter_dir = out / "adapter"
        self.lm.model.save_pretrained(str(adapter_dir))  # type: ignore[operator]
        if self.cfg.save_merged:
            path = self.model_path
            merged = PeftModel.from_pretrained(
                load_causal_lm(path), str(adapter_dir)
            ).merge_and_unload()
            merged.save_pretrained(str(out / "merged"))  # type: ignore[operator]
            load_tokenizer(path).save_pretrained(str(out / "merged"))
        return adapter_dir
