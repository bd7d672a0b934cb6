"""Small random-weight models of six Hugging Face architectures, written with transformers' own config classes.

Shared by the federation, privacy, verifier and export tests of each architecture. Each is
saved with the micro zoo's tokenizer (vocabulary 1024) so every fedge path can load it by
directory, as it would a downloaded model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

SMALL = {
    "vocab_size": 1024,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
}
DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
ARCHITECTURES = {
    # name: (config, LoRA-adapted module names "auto" must pick)
    "llama": (transformers.LlamaConfig(**SMALL, **DECODER), {"q_proj", "v_proj"}),
    "qwen2": (transformers.Qwen2Config(**SMALL, **DECODER), {"q_proj", "v_proj"}),
    "mistral": (transformers.MistralConfig(**SMALL, **DECODER), {"q_proj", "v_proj"}),
    # Gemma and GPT-2 tie their head to the embedding by default: a random tied model scores
    # the last token highest and only repeats it, so every draft would agree. Untied here
    # (their classes take either); the micro zoo's tied head has its own export tests
    "gemma": (
        transformers.GemmaConfig(**SMALL, **DECODER, head_dim=16, tie_word_embeddings=False),
        {"q_proj", "v_proj"},
    ),
    "gpt2": (
        transformers.GPT2Config(
            vocab_size=1024,
            n_positions=64,
            n_embd=32,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=False,
        ),
        {"c_attn"},
    ),
    "phi3": (
        transformers.Phi3Config(**SMALL, **DECODER),
        {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    ),
}


def model_dir(name: str, root: Path, micro_zoo, seed: int = 0) -> Path:  # type: ignore[no-untyped-def]
    """A random-weight model of the architecture (weights from `seed`), saved with the micro zoo's tokenizer."""
    config, _ = ARCHITECTURES[name]
    path = root / f"{name}-{seed}"
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(micro_zoo.target_dir / f, path / f)
    return path


def random_gqa(
    arch: str, seed: int, *, heads: int, kv_heads: int, positions: int = 64, **shape: Any
) -> transformers.PreTrainedModel:
    """A random-weight decoder of `arch` ("llama", "qwen2") whose query heads share key heads
    (grouped-query attention), vocabulary 1024, 128 wide and 2 layers unless `shape` says."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    sizes = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256}
    sizes |= {"num_hidden_layers": 2, **shape}
    config = config_class(
        **sizes,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def write_text(root: Path, clients: int = 2) -> Path:
    """A few KB of text per client (numpy's source) as a federation's data source."""
    source = Path(np.__file__).read_text()
    for i in range(clients):
        (root / f"c{i}").mkdir(parents=True)
        (root / f"c{i}" / "text.txt").write_text(source[6000 * i : 6000 * (i + 1)])
    return root


def greedy_reference(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own greedy continuation of `prompt`: what speculative decoding must equal."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=1
    )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]
