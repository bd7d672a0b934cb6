"""Verifier request types and their validation: ids in the vocabulary, well-formed draft distributions."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedge.edge.verifier.errors import InvalidRequest

MAX_TEMPERATURE = 10.0
PROB_SUM_TOLERANCE = 1e-3  # float32 softmax over a top-k support sums to 1 within ~1e-6
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # 128 random bits fit in 32 hex characters


@dataclass(frozen=True)
class Sampling:
    """Target decoding rule of a session: temperature 0 is greedy."""

    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class SessionInfo:
    """What a client learns when it opens a session."""

    session_id: str
    vocab_size: int
    max_draft: int
    max_context: int
    session_ttl_s: float
    model_id: str = (
        ""  # digests of the served weights, adapter and tokenizer (fedge.edge.verifier.identity)
    )
    adapter_id: str = ""
    tokenizer_id: str = ""

    @property
    def version(self) -> str:
        """The version the session is served on: `model_id/adapter_id`."""
        return f"{self.model_id}/{self.adapter_id}"


@dataclass(frozen=True)
class VerifyResult:
    """Accepted prefix length, the next token, and the session's length afterwards."""

    accepted: int
    next_token: int
    session_length: int


@dataclass(frozen=True)
class Draft:
    """A validated draft: ids plus, when sampling, q(ids) and the dense q rows [k, V]."""

    ids: list[int]
    probs: torch.Tensor | None = None
    dists: torch.Tensor | None = None


def check_ids(field: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    """Token ids must lie in [0, vocab_size)."""
    values = [int(i) for i in ids]
    bad = [i for i in values if not 0 <= i < vocab_size]
    if bad:
        raise InvalidRequest(field, f"id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return values


def derive_seed(session_id: str) -> int:
    """A session's default sampling seed, from its id (edge-chosen ids need not be hex)."""
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:7], "big")


def position_seed(seed: int, position: int) -> int:
    """The seed of a session's random draws at `position` (its length when they are drawn).

    Draws are a function of (session seed, position), not of how many came before on
    this replica: a session reopened elsewhere continues the same random stream, so
    sampling stays exact across failover (re-seeding at the start replayed old draws).
    """
    digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch seeds are < 2**64; keep it signed-safe


def check_session_id(session_id: str) -> str:
    """A session id is 1 .. 64 characters of [A-Za-z0-9_-]."""
    if not SESSION_ID.fullmatch(session_id):
        raise InvalidRequest(
            "session_id",
            f"{session_id[:80]!r} is not 1 .. 64 characters of [A-Za-z0-9_-]; "
            "use 32 random hex characters",
        )
    return session_id


def check_sampling(sampling: Sampling) -> None:
    """Temperature must lie in [0, MAX_TEMPERATURE]; seed must be non-negative."""
    if not 0.0 <= sampling.temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(
            "sampling.temperature",
            f"{sampling.temperature} is outside [0, {MAX_TEMPERATURE}]; use 0 for greedy",
        )
    if sampling.seed < 0:
        raise InvalidRequest("sampling.seed", f"{sampling.seed} must be >= 0")


def sampling_draft(
    ids: list[int],
    draft_probs: Sequence[float],
    draft_dists: Sequence[tuple[Sequence[int], Sequence[float]]],
    vocab_size: int,
) -> Draft:
    """Validate q(ids) and the sparse draft distributions of a sampling draft; densify q to [k, V]."""
    if len(draft_probs) != len(ids) or len(draft_dists) != len(ids):
        raise InvalidRequest(
            "draft_probs",
            f"sampling needs draft_probs and draft_dists for each of the {len(ids)} drafted "
            f"tokens, got {len(draft_probs)} and {len(draft_dists)}",
        )
    dense = torch.zeros(len(ids), vocab_size, dtype=torch.float64)
    for i, (support, probs) in enumerate(draft_dists):
        dense[i] = dense_row(i, support, probs, vocab_size)
    q = torch.tensor([float(p) for p in draft_probs], dtype=torch.float64)
    for i, token in enumerate(ids):
        if not 0.0 < float(q[i]) <= 1.0:  # also refuses NaN: every comparison with NaN is False
            raise InvalidRequest("draft_probs", f"entry {i} is {float(q[i])}, not in (0, 1]")
        if abs(float(dense[i, token]) - float(q[i])) > PROB_SUM_TOLERANCE:
            raise InvalidRequest(
                "draft_probs",
                f"entry {i} ({float(q[i]):.6f}) differs from draft_dists[{i}] at the "
                f"drafted token ({float(dense[i, token]):.6f})",
            )
    return Draft(ids, q, dense)


def dense_row(
    i: int, support: Sequence[int], probs: Sequence[float], vocab_size: int
) -> torch.Tensor:
    """Turn one sparse draft distribution into a dense [V] row, validating it."""
    field = f"draft_dists[{i}]"
    ids = check_ids(f"{field}.token_ids", support, vocab_size)
    if len(ids) != len(probs) or not ids:
        raise InvalidRequest(
            field,
            f"needs equal, non-zero counts of token_ids and probs, got {len(ids)} and {len(probs)}",
        )
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"{field}.token_ids", "ids must be distinct")
    values = torch.tensor([float(p) for p in probs], dtype=torch.float64)
    bad = [j for j, p in enumerate(values.tolist()) if not (math.isfinite(p) and 0.0 <= p <= 1.0)]
    if bad:
        raise InvalidRequest(
            f"{field}.probs", f"entry {bad[0]} is {float(values[bad[0]])}, not in [0, 1]"
        )
    if abs(float(values.sum()) - 1.0) > PROB_SUM_TOLERANCE:
        raise InvalidRequest(
            f"{field}.probs",
            f"must be non-negative and sum to 1 (±{PROB_SUM_TOLERANCE}), sum is {float(values.sum()):.6f}",
        )
    row = torch.zeros(vocab_size, dtype=torch.float64)
    row[torch.tensor(ids)] = values / values.sum()
    return row
