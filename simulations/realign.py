"""Realign the edge draft with a federated target, through the same federation, and measure it.

A federation fine-tunes the target's LoRA adapter; the draft was distilled from the base
target, so its greedy agreement with the moved target falls. `realign_draft` runs a second
federation on the same scenario (strategy, SecAgg+, DP, clients) whose model is the draft
and whose clients distil from the federated target on their own data
(``distill-teacher``, see fedge.lm.distill), on the teacher's own greedy continuations of
their text (``distill-generate``) with a LoRA adapter on every linear layer of the draft
(``REALIGN_OVERRIDES``); the server merges the result into a plain
model directory, which the edge exports and quantizes like the base draft.
`acceptance_by_client` measures, on each participating client's held-out prompts, the
draft's greedy agreement with the target for the three pairs that matter: base draft vs
base target (before federation), base draft vs federated target (drift), realigned draft
vs federated target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedge import keys
from fedge.lm import holder
from fedge.models import load_causal_lm
from fedge.server.config import RunConfig
from fedge.server.rundir import MetricsLog
from fedge.simulations.runner import Scenario, run_simulation
from fedge.zoo.evaluate import greedy_agreement, prompts_from

PROMPT_TOKENS = 32  # prompt length, as in the zoo card's agreement figure
MIN_PROMPT_TOKENS = 4  # below this a prompt carries too little context to compare drafts on
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
REALIGN_OVERRIDES: dict[str, Any] = {
    # Sequence-level KD: the teacher writes the last 32 tokens of every window, the path
    # greedy speculative decoding verifies (demo zoo: 59.2% vs 54.6% with the client's text
    # alone, base draft vs base target 57.5%).
    keys.CFG_DISTILL_GENERATE: 32,
    # A one- or two-layer draft has little to adapt in attention alone: its MLP too
    # (demo zoo: 63.0% vs 59.2% with q,k,v,o at rank 8).
    "lora-target-modules": ALL_LINEAR,
    "lora-r": 16,
    "lora-alpha": 32,
}


@dataclass(frozen=True)
class ClientAcceptance:
    """Greedy agreement of draft with target on one client's held-out prompts (draft length 4)."""

    partition: int
    base: float  # base draft vs base target: what the edge had before the federation
    drifted: float  # base draft vs federated target: what it has after, without realignment
    realigned: float  # realigned draft vs federated target
    prompt_tokens: int = PROMPT_TOKENS  # shorter for a client with little held-out code; 0 = none

    @property
    def measured(self) -> bool:
        """False for a client whose held-out split is too short for even a minimal prompt."""
        return self.prompt_tokens > 0

    def as_row(self) -> dict[str, Any]:
        """JSON-ready row (rates are null for a client with nothing to measure)."""
        rate = lambda value: round(value, 4) if self.measured else None  # noqa: E731
        return {
            "partition": self.partition,
            "prompt_tokens": self.prompt_tokens,
            "base_vs_base": rate(self.base),
            "base_vs_federated": rate(self.drifted),
            "realigned_vs_federated": rate(self.realigned),
        }


def realign_scenario(
    scenario: Scenario,
    draft_dir: Path,
    teacher_dir: Path,
    overrides: Mapping[str, Any] = REALIGN_OVERRIDES,
) -> Scenario:
    """The same scenario (strategy, aggregator, DP, clients) with the draft as model and the
    federated target as every client's teacher; `overrides` set the draft's adapter and KD."""
    config = scenario.config.with_overrides(
        {
            **overrides,
            keys.CFG_MODEL: str(draft_dir),
            keys.CFG_DISTILL_TEACHER: str(Path(teacher_dir).resolve()),
            "save-merged": True,
        }
    )
    return replace(scenario, config=config)


def realign_draft(
    scenario: Scenario,
    draft_dir: Path,
    teacher_dir: Path,
    run_dir: Path,
    on_row: Callable[[Mapping[str, Any]], None] | None = None,
    overrides: Mapping[str, Any] = REALIGN_OVERRIDES,
) -> Path:
    """Run the realignment federation; return the realigned draft's merged model directory."""
    outcome = run_simulation(
        realign_scenario(scenario, draft_dir, teacher_dir, overrides), run_dir, on_row=on_row
    )
    merged = run_dir / "final" / "merged"
    if outcome is None or outcome.status == "failed" or not merged.is_dir():
        message = outcome.message if outcome is not None else "the ServerApp did not finish"
        raise RuntimeError(f"draft realignment failed: {message} (run dir {run_dir})")
    return merged


def participating(run_dir: Path) -> list[int]:
    """Partitions that trained in at least one round of the run in `run_dir`."""
    trained = {p for row in MetricsLog(run_dir).rows() for p in row.get("partitions_trained", [])}
    return sorted(trained)


def acceptance_by_client(
    config: RunConfig,
    partitions: Sequence[int],
    models: Mapping[str, Path],
    prompts: int = 6,
    new_tokens: int = 32,
    prompt_tokens: int = PROMPT_TOKENS,
) -> list[ClientAcceptance]:
    """Agreement per client for base/federated targets and base/realigned drafts.

    `models` names four model dirs: base_target, federated_target, base_draft, realigned_draft.
    `config` is the federation's run config (its corpus and partitioning). Every partition gets
    a row, so the table counts the clients the federation ran: a client with little held-out code
    gets prompts shortened to fit, and one without room for even `MIN_PROMPT_TOKENS` gets a row
    that says it was not measured.
    """
    loaded = {name: load_causal_lm(path).eval() for name, path in models.items()}
    corpus = holder.get_corpus(
        {**config.client_config(), keys.CFG_MODEL_PATH: str(models["base_target"])}
    )
    rows = []
    for pid in partitions:
        heldout = np.asarray(corpus.client(pid).heldout)
        fitted = min(prompt_tokens, len(heldout) - new_tokens)
        if fitted < MIN_PROMPT_TOKENS:
            rows.append(ClientAcceptance(pid, math.nan, math.nan, math.nan, prompt_tokens=0))
            continue
        picks = prompts_from(heldout[: len(heldout) - new_tokens], prompts, fitted)

        def rate(target: str, draft: str, picks: list[np.ndarray] = picks) -> float:
            return greedy_agreement(loaded[target], loaded[draft], picks, new_tokens).rate

        rows.append(
            ClientAcceptance(
                pid,
                base=rate("base_target", "base_draft"),
                drifted=rate("federated_target", "base_draft"),
                realigned=rate("federated_target", "realigned_draft"),
                prompt_tokens=fitted,
            )
        )
    return rows
