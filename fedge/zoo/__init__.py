"""The built-in model zoo: a tokenizer, a target LM and a draft LM trained offline on the stdlib."""

from fedge.zoo.build import ZooPaths, build_zoo, ensure_zoo, zoo_problems
from fedge.zoo.presets import PRESETS, ZooPreset, get_preset

__all__ = [
    "PRESETS",
    "ZooPaths",
    "ZooPreset",
    "build_zoo",
    "ensure_zoo",
    "get_preset",
    "zoo_problems",
]
