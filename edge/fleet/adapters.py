"""Does a LoRA adapter fit the base model? Checked before any traffic reaches it.

Checks, in order, each failure naming the file: the directory and its
`adapter_config.json` (peft LoRA), the weights file, the directory's fedge
manifest when it has one (sha256 of every file), every LoRA tensor's shape
against the base model's module it targets (built on the meta device: no base
weights are loaded) and against the config's rank (lora_A [r, in], lora_B
[out, r]), and every value finite. All of it runs before any replica stops.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fedge.errors import FedgeError
from fedge.manifest import MANIFEST_NAME, verify_manifest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."


class AdapterMismatch(FedgeError):
    """The adapter cannot be served on this base model; the message names the file."""


def check_adapter(model_dir: Path, adapter_dir: Path) -> dict[str, Any]:
    """Raise AdapterMismatch unless `adapter_dir` is an intact LoRA adapter of `model_dir`; return its config."""
    if not adapter_dir.is_dir():
        raise AdapterMismatch(f"{adapter_dir} is not a directory; pass a peft adapter directory")
    config = _read_config(adapter_dir / CONFIG_FILE)
    weights = next((adapter_dir / n for n in WEIGHT_FILES if (adapter_dir / n).is_file()), None)
    if weights is None:
        raise AdapterMismatch(
            f"{adapter_dir / WEIGHT_FILES[0]} is missing (nor is there {WEIGHT_FILES[1]}); "
            "copy the adapter's weights beside its config"
        )
    if (adapter_dir / MANIFEST_NAME).is_file():
        problems = verify_manifest(adapter_dir)
        if problems:
            raise AdapterMismatch(
                f"{adapter_dir}: {'; '.join(problems)} (checked against {MANIFEST_NAME}); "
                "copy the adapter again"
            )
    shapes = _tensor_shapes(weights)
    _check_shapes(model_dir, weights, shapes)
    _check_ranks(weights, shapes, config)
    _check_finite(weights)
    return config


def _read_config(path: Path) -> dict[str, Any]:
    """The adapter's peft config; it must be a LoRA config."""
    if not path.is_file():
        raise AdapterMismatch(f"{path} is missing; save the adapter with peft's save_pretrained")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise AdapterMismatch(f"{path} is not valid JSON ({err})") from err
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterMismatch(f"{path} is not a LoRA config (peft_type must be LORA)")
    return config


def _tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the adapter's weights file."""
    try:
        if weights.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(weights), framework="pt") as handle:
                return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
        import torch

        state = torch.load(weights, map_location="cpu", weights_only=True)
        return {k: tuple(v.shape) for k, v in state.items()}
    except Exception as err:  # any unreadable file is the same finding for the operator
        raise AdapterMismatch(f"{weights} cannot be read as adapter weights ({err})") from err


def _base_linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Module name -> (in_features, out_features) of every Linear in the base model (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def _check_shapes(model_dir: Path, weights: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every lora_A is [r, in] and every lora_B is [out, r] of the base module it names."""
    linear = _base_linear_shapes(model_dir)
    lora = {k: v for k, v in shapes.items() if ".lora_A." in k or ".lora_B." in k}
    if not lora:
        raise AdapterMismatch(f"{weights} holds no lora_A / lora_B tensors")
    for key, shape in sorted(lora.items()):
        part = ".lora_A." if ".lora_A." in key else ".lora_B."
        module = key.split(part)[0].removeprefix(PEFT_PREFIX)
        if module not in linear:
            raise AdapterMismatch(
                f"{weights}: tensor {key} targets {module}, which the base model "
                f"{model_dir} does not have"
            )
        in_features, out_features = linear[module]
        fits = (
            len(shape) == 2 and shape[1] == in_features
            if part == ".lora_A."
            else len(shape) == 2 and shape[0] == out_features
        )
        if not fits:
            expected = f"[r, {in_features}]" if part == ".lora_A." else f"[{out_features}, r]"
            raise AdapterMismatch(
                f"{weights}: tensor {key} has shape {list(shape)}, but {module} of the base "
                f"model needs {expected}; the adapter was trained on another base model"
            )


def _rank_of(module_key: str, config: dict[str, Any]) -> int:
    """The LoRA rank the config gives a module: its `rank_pattern` entry, else `r`."""
    for pattern, rank in (config.get("rank_pattern") or {}).items():
        if module_key.endswith(pattern) or re.fullmatch(pattern, module_key):
            return int(rank)
    return int(config.get("r", 0))


def _check_ranks(weights: Path, shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> None:
    """lora_A is [r, in] and lora_B is [out, r] with the config's r (a mismatch cannot multiply)."""
    for key, shape in sorted(shapes.items()):
        part = ".lora_A." if ".lora_A." in key else ".lora_B." if ".lora_B." in key else ""
        if not part:
            continue
        module = key.split(part)[0].removeprefix(PEFT_PREFIX)
        rank = _rank_of(module, config)
        got = shape[0] if part == ".lora_A." else shape[-1]
        if got != rank:
            raise AdapterMismatch(
                f"{weights}: tensor {key} has rank {got}, but {CONFIG_FILE} gives {module} "
                f"rank {rank}; the weights and the config come from different adapters"
            )


def _check_finite(weights: Path) -> None:
    """Every value of every tensor is finite (a NaN or inf would poison every token served)."""
    import torch

    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    for key, tensor in sorted(state.items()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise AdapterMismatch(
                f"{weights}: tensor {key} holds {bad} non-finite values (NaN or inf); the "
                "training run diverged: serve an earlier round's adapter"
            )
