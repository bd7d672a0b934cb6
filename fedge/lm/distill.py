"""The local training loss: next-token cross-entropy, or distillation from a teacher (draft realignment).

After a federation moves the target, the edge draft (distilled from the base target) drifts
out of agreement with it. Realignment runs a second federation over the draft's LoRA adapter
with the same strategies, SecAgg+ and DP, where each client's loss is KL(teacher || draft)
on its own data and the teacher is the federated target (``distill-teacher``, a model dir on
every client); with ``distill-generate`` the teacher first writes the tail of every window
(sequence-level KD). Everything else in the round is unchanged: only the loss and the
batches it sees differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from fedge.keys import CFG_DISTILL_GENERATE, CFG_DISTILL_TEACHER, CFG_DISTILL_TEMPERATURE
from fedge.lm.evaluate import lm_batch_loss
from fedge.types import ConfigValue
from fedge.zoo.training import distillation_loss, greedy_continuation

BatchLoss = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
_TEACHERS: dict[str, torch.nn.Module] = {}  # one frozen teacher per worker process and path


def teacher_model(path: str) -> torch.nn.Module:
    """The teacher at `path`, loaded once per process, frozen and in eval mode."""
    if path not in _TEACHERS:
        from fedge.models import load_causal_lm

        if not Path(path).is_dir():
            raise ValueError(
                f"{CFG_DISTILL_TEACHER}={path!r} is not a model directory on this client; "
                "point it at the federated target's merged model (run dir final/merged)"
            )
        teacher = load_causal_lm(path).eval()
        teacher.requires_grad_(False)
        _TEACHERS.clear()  # a new federation's teacher replaces the last one
        _TEACHERS[path] = teacher
    return _TEACHERS[path]


def batch_loss(config: Mapping[str, ConfigValue]) -> BatchLoss:
    """The loss a client trains with: KL to the configured teacher, else next-token CE."""
    teacher = str(config.get(CFG_DISTILL_TEACHER, ""))
    if not teacher:
        return lm_batch_loss
    temperature = float(config.get(CFG_DISTILL_TEMPERATURE, 1.0))
    if temperature <= 0:
        raise ValueError(f"{CFG_DISTILL_TEMPERATURE} must be > 0, got {temperature}")
    return distillation_loss(teacher_model(teacher), temperature)


def teacher_batches(
    config: Mapping[str, ConfigValue], batches: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The round's batches, each window's tail replaced by the teacher's greedy continuation.

    With ``distill-generate`` = G > 0 every window keeps its first tokens as a prompt and the
    teacher writes the last G (sequence-level KD: the draft learns the path the target will
    take); one batched generation serves the whole round. G = 0 or no teacher: unchanged.
    """
    teacher = str(config.get(CFG_DISTILL_TEACHER, ""))
    generate = int(config.get(CFG_DISTILL_GENERATE, 0))
    if generate < 0:
        raise ValueError(
            f"{CFG_DISTILL_GENERATE} must be >= 0 (0: the client's text), got {generate}"
        )
    if not teacher or not generate or not batches:
        return batches
    rows = greedy_continuation(teacher_model(teacher), torch.cat(batches), generate)
    return list(rows.split([len(b) for b in batches]))


def refuse_dpsgd(config: Mapping[str, ConfigValue]) -> None:
    """Distillation under sample-level DP-SGD is not supported: say what works instead."""
    if config.get(CFG_DISTILL_TEACHER):
        raise ValueError(
            f"{CFG_DISTILL_TEACHER} with DP-SGD is not supported: realign the draft with "
            "distributed DP under SecAgg+ (aggregator secagg_distributed_dp) or central DP"
        )
