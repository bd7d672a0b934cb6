"""`fedge demo --preset NAME` for a pretrained model: every size of every stage in one place.

The federation's sizes (clients, rounds, local steps, batch, sequence length, LoRA, lr) are the
preset's scenario file (``simulations/scenarios/<scenario>.toml``); everything else (the draft's
build budget, the private run's DP, the edge's prompts and tokens, whether the draft is
realigned) is the preset's :class:`PretrainedDemo` here. ``FEDGE_DEMO_SET`` still overrides the
federation's keys, as for the zoo demo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedge.edge.demo import EdgeSizes
from fedge.simulations.demo import PRIVATE_OVERRIDES


@dataclass(frozen=True)
class PretrainedDemo:
    """One pretrained-model demo: which model, which federation, and each stage's budget."""

    name: str
    model: str  # a `fedge models fetch` catalog name
    scenario: str  # the federation's scenario: every federation size
    draft_minutes: float  # wall-time budget to build the draft when none is cached
    private: dict[str, Any]  # the SecAgg+ / distributed-DP run's overrides
    edge: EdgeSizes
    realign_skipped: str = ""  # why the draft is not realigned ("" = realign it)
    max_instruction_tokens: int = 96  # edge prompts: held-out instructions at most this long


# SmolLM2-135M on 2 cores. A LoRA step of 4 x 256 tokens takes ~3.7 s in bf16, so the scenario
# trains 4 x 128 in fp32 (6 clients x 4 steps x 2 rounds, twice). DP: the rounds of every client at
# noise multiplier 1.5 keep the RDP epsilon under 8. Realignment would be a third federation over the
# draft with SmolLM2 writing every window's continuation (sequence-level KD) on each client,
# about as long as both fine-tuning federations together: over the 15-minute budget.
SMOLLM2 = PretrainedDemo(
    name="smollm2",
    model="smollm2-135m",
    scenario="smollm2",
    draft_minutes=55.0,
    private={**PRIVATE_OVERRIDES, "dp-noise-multiplier": 1.5},
    # torch verifier: an ONNX export of the merged target costs minutes on the first run
    edge=EdgeSizes(
        validation_prompts=4, prompts=3, new_tokens=40, sample_tokens=48, verifier_runtime="torch"
    ),
    realign_skipped=(
        "realignment is a third federation in which SmolLM2 writes every client window's "
        "continuation: about as long as both fine-tuning federations together, over the "
        "preset's 15-minute budget on 2 cores"
    ),
)

PRETRAINED_DEMOS: dict[str, PretrainedDemo] = {SMOLLM2.name: SMOLLM2}
