"""Which modules get LoRA adapters: named by the user, or chosen per architecture ("auto").

``lora-target-modules = "auto"`` (the default) asks peft for its own per-architecture
defaults (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``, keyed by the config's
``model_type``: ``q_proj,v_proj`` for Llama, Qwen2, Mistral and Gemma, ``c_attn`` for
GPT-2) and, for an architecture peft does not list (Phi-3's fused ``qkv_proj``, for one),
falls back to peft's ``"all-linear"``: every linear layer except the output head. Any
other value is a comma-separated list of module names, used as given.
"""

from __future__ import annotations

from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

AUTO = "auto"
ALL_LINEAR = "all-linear"  # peft's own spelling: every nn.Linear (and Conv1D) but the LM head


def named_targets(spec: str, model_type: str, linear_names: list[str]) -> list[str]:
    """The module names `spec` adapts on `model_type`, for cost models that never load the model.

    `linear_names` are the architecture's linear layers (what "all-linear" would take).
    """
    chosen = lora_targets(spec, model_type)
    if chosen is None:
        return sorted(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type])
    if chosen == ALL_LINEAR:
        return list(linear_names)
    return list(chosen)


def lora_targets(spec: str, model_type: str) -> list[str] | str | None:
    """What to pass as peft's ``target_modules``: None lets peft apply its architecture default."""
    if spec.strip() != AUTO:
        return [m.strip() for m in spec.split(",") if m.strip()]
    if model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
        return None
    return ALL_LINEAR
