"""Byte-level BPE tokenizer trained on the corpus, saved for `AutoTokenizer.from_pretrained`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# How a tokenizer was loaded, not what it is: `from_pretrained` records the hub's offline mode
# (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) here, so the same build under another environment
# would write other bytes.
LOADER_STATE_KEYS = ("local_files_only",)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...]
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (every byte representable: no unknown token) on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1 << 20,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Write the tokenizer files into a model directory, the same bytes whatever the environment
    it was loaded under (the zoo's manifests hash them)."""
    tokenizer.save_pretrained(directory)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in LOADER_STATE_KEYS:
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
