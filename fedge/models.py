"""Load causal LMs and tokenizers through the ordinary Hugging Face interfaces, with clear errors.

A local directory that carries a fedge manifest is verified before use; a hub id works where a hub
is reachable, and offline an unknown id says how to build or point at a local model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from fedge.errors import ModelNotFoundError
from fedge.manifest import read_manifest, require_intact

_HOW_TO = (
    "Build the built-in zoo with `fedge models build --preset default` and pass its "
    "`target`/`draft` directory, or pass any local Hugging Face model directory."
)


def _local_dir(path_or_id: str | Path) -> Path | None:
    """The directory `path_or_id` names on this machine, verified against its manifest."""
    path = Path(path_or_id).expanduser()
    if not path.exists():
        if isinstance(path_or_id, Path) or str(path_or_id).startswith((".", "/", "~")):
            raise ModelNotFoundError(f"Model directory {path} does not exist. {_HOW_TO}")
        return None
    if not path.is_dir():
        raise ModelNotFoundError(f"{path} is a file, not a model directory. {_HOW_TO}")
    if read_manifest(path) is not None:
        require_intact(path)
    elif not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} has no config.json: it is not a Hugging Face model directory. {_HOW_TO}"
        )
    return path


def load_causal_lm(path_or_id: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` in eval mode, with a verified local directory."""
    local = _local_dir(path_or_id)
    try:
        model = AutoModelForCausalLM.from_pretrained(local or str(path_or_id), dtype=dtype)
    except OSError as err:
        raise ModelNotFoundError(
            f"Cannot load model {str(path_or_id)!r}: {err}. Offline (HF_HUB_OFFLINE=1) only local "
            f"directories and cached hub ids work. {_HOW_TO}"
        ) from err
    return model.eval()


def load_tokenizer(path_or_id: str | Path) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained`, with a pad token guaranteed (eos when the model has none)."""
    local = _local_dir(path_or_id)
    try:
        tokenizer = AutoTokenizer.from_pretrained(local or str(path_or_id))
    except OSError as err:
        raise ModelNotFoundError(
            f"Cannot load tokenizer {str(path_or_id)!r}: {err}. {_HOW_TO}"
        ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
