"""Speculative decoding on the edge: draft k tokens locally, verify them in one target pass remotely.

The draft runtime keeps its KV cache across rounds and rolls it back to the
accepted prefix after each verify; the verifier keeps the target's cache in its
session. Greedy mode reproduces the target's greedy output token for token;
sampling mode reports the draft's distributions so the verifier's acceptance
rule (fedge.edge.speculative) leaves the target's distribution intact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fedge.edge.draftlen import SpeculationEstimator
from fedge.edge.runtime import DraftRuntime
from fedge.edge.verifier.engine import Sampling, SessionInfo, VerifyResult


class VerifierLink(Protocol):
    """The verifier as the decoder sees it: `VerifierClient` over gRPC, or a `VerifierEngine`."""

    def open(self, prompt_ids: Sequence[int], sampling: Sampling | None = None) -> SessionInfo: ...

    def verify(
        self,
        session_id: str,
        draft_ids: Sequence[int],
        draft_probs: Sequence[float] = (),
        draft_dists: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
    ) -> VerifyResult: ...

    def close(self, session_id: str) -> int: ...


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding knobs shared by the speculative, edge-only and cloud-only paths."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # edge sampling RNG; the verifier's is seeded per session
    draft_len: int = 4  # initial draft length
    min_draft: int = 1
    max_draft: int = 16  # the verifier's own max_draft caps it too
    adaptive: bool = (
        True  # draft length from the tokens/s objective (fedge.edge.draftlen), else fixed
    )
    draft_top_k: int = 32  # draft samples from its top-k when sampling: bounds bytes up per token
    # Greedy: a round stops drafting once the draft's own probability that every token drafted
    # so far is the target's (the product of its top probabilities) falls below this, so an
    # unsure draft does not spend draft steps and verify positions on tokens the target rejects
    # (0, the default: draft the length asked). SmolLM2's 4 + 2 draft agreed 26% where its top
    # probability was < 0.2 and 96% where it was >= 0.9; replayed offline, 0.1 decoded ~9% faster
    # than the best fixed length (bench/results/draft_confidence.json), but live beside the
    # length estimator it measured 1.17x plain at RTT 0 against 1.30x without (0.97x against
    # 0.91x at 20 ms), and under a ceiling of max_draft 1.30x / 0.86x: off (docs/edge.md).
    confidence_floor: float = 0.0
    stop_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"DecodeConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"DecodeConfig.temperature must be >= 0, got {self.temperature}")
        if not 1 <= self.min_draft <= self.draft_len <= self.max_draft:
            raise ValueError(
                "DecodeConfig needs 1 <= min_draft <= draft_len <= max_draft, got "
                f"{self.min_draft}, {self.draft_len}, {self.max_draft}"
            )
        if self.draft_top_k < 1:
            raise ValueError(f"DecodeConfig.draft_top_k must be >= 1, got {self.draft_top_k}")
        if not 0.0 <= self.confidence_floor < 1.0:
            raise ValueError(
                f"DecodeConfig.confidence_floor must lie in [0, 1), got {self.confidence_floor}"
            )


@dataclass
class DecodeStats:
    """What one generation cost: tokens, verify rounds, acceptance, bytes, time."""

    tokens: int = 0
    rounds: int = 0  # target passes (one per verify)
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # wall time waiting on the verifier, network included
    draft_lengths: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        """Fraction of drafted tokens the target accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per wall-clock second."""
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def passes_per_token(self) -> float:
        """Target forward passes per generated token (1.0 for cloud-only decoding)."""
        return self.rounds / self.tokens if self.tokens else 0.0


def top_probability(logits: np.ndarray) -> float:
    """The softmax probability of the best-scored token (the draft's confidence in its pick)."""
    shifted = logits.astype(np.float64) - float(logits.max())
    return float(1.0 / np.exp(shifted).sum())


class DraftSampler:
    """Turns draft logits into a token plus what the verifier needs to judge it."""

    def __init__(self, temperature: float, top_k: int, seed: int) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self._rng = np.random.default_rng(seed)

    def choose(self, logits: np.ndarray) -> tuple[int, float, tuple[list[int], list[float]]]:
        """Greedy: (argmax, 1.0, ([], [])). Sampling: a token from top-k softmax, q(token), and q."""
        if self.temperature == 0.0:
            return int(np.argmax(logits)), 1.0, ([], [])
        k = min(self.top_k, logits.shape[0])
        support = np.argpartition(-logits, k - 1)[:k]
        scaled = logits[support].astype(np.float64) / self.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        pick = int(self._rng.choice(k, p=probs))
        return int(support[pick]), float(probs[pick]), (support.tolist(), probs.tolist())


class SpeculativeDecoder:
    """Draft on the device, verify in the cloud, stream accepted tokens as they land."""

    def __init__(
        self,
        runtime: DraftRuntime,
        link: VerifierLink,
        config: DecodeConfig,
        estimator: SpeculationEstimator | None = None,
    ) -> None:
        self.runtime = runtime
        self.link = link
        self.config = config
        self.estimator = estimator or SpeculationEstimator()  # shared across requests by callers
        self.stats = DecodeStats()

    def _next_draft_len(self) -> int:
        """The objective's draft length once a verify was measured, else the configured start."""
        cfg = self.config
        if not cfg.adaptive or not self.estimator.verifies:
            return cfg.draft_len
        return self.estimator.best_draft_len(cfg.min_draft, cfg.max_draft)

    def stream(self, prompt_ids: Sequence[int]) -> Iterator[list[int]]:
        """Yield each verify's tokens (accepted drafts plus the target's next token)."""
        cfg = self.config
        self.stats = stats = DecodeStats()
        sampler = DraftSampler(cfg.temperature, cfg.draft_top_k, cfg.seed)
        started = time.perf_counter()
        info = self.link.open(prompt_ids, Sampling(cfg.temperature, cfg.seed))
        try:
            self.runtime.reset()
            committed = list(prompt_ids)
            limit = min(info.max_context, self.runtime.max_context)
            while stats.tokens < cfg.max_new_tokens and len(committed) < limit:
                room = min(cfg.max_new_tokens - stats.tokens, limit - len(committed)) - 1
                k = max(0, min(self._next_draft_len(), room, info.max_draft))
                tick = time.perf_counter()
                drafts, probs, dists = self._draft(committed, k, sampler)
                k = len(drafts)  # fewer than asked when the draft grew unsure (confidence_floor)
                tock = time.perf_counter()
                result = self.link.verify(info.session_id, drafts, probs, dists)
                called = time.perf_counter() - tock
                stats.draft_seconds += tock - tick
                stats.verify_seconds += called
                self.estimator.observe(k, result.accepted, tock - tick, called)
                # the draft cache holds committed + drafts[:k-1] (all k when drafting stopped
                # early); keep what the target accepted
                self.runtime.truncate(min(self.runtime.length, len(committed) + result.accepted))
                new = [*drafts[: result.accepted], result.next_token]
                new = self._cut_at_stop(new)
                committed += new
                stats.rounds += 1
                stats.drafted += k
                stats.accepted += result.accepted
                stats.tokens += len(new)
                stats.draft_lengths.append(k)
                yield new
                if cfg.stop_token_id is not None and new[-1] == cfg.stop_token_id:
                    break
        finally:
            stats.seconds = time.perf_counter() - started
            self.link.close(info.session_id)

    def generate(self, prompt_ids: Sequence[int]) -> list[int]:
        """All generated tokens (no prompt)."""
        return [t for chunk in self.stream(prompt_ids) for t in chunk]

    def _draft(
        self, committed: list[int], k: int, sampler: DraftSampler
    ) -> tuple[list[int], list[float], list[tuple[list[int], list[float]]]]:
        """Draft up to k tokens after `committed`, feeding the draft only what its cache lacks;
        greedy drafting stops early where the draft grew unsure (`confidence_floor`)."""
        drafts: list[int] = []
        probs: list[float] = []
        dists: list[tuple[list[int], list[float]]] = []
        if k == 0:
            return drafts, probs, dists
        floor = self.config.confidence_floor if sampler.temperature == 0 else 0.0
        likely = 1.0  # the draft's probability that every token drafted so far is the target's
        logits = self.runtime.extend(committed[self.runtime.length :])
        for i in range(k):
            token, q, dist = sampler.choose(logits)
            if floor:  # the softmax over the vocabulary only when a floor asks for it
                likely *= top_probability(logits)
                if i > 0 and likely < floor:
                    break
            drafts.append(token)
            if sampler.temperature > 0:
                probs.append(q)
                dists.append(dist)
            if i < k - 1:
                logits = self.runtime.extend([token])
        return drafts, probs, dists

    def _cut_at_stop(self, tokens: list[int]) -> list[int]:
        """Drop everything after the stop token."""
        stop = self.config.stop_token_id
        if stop is not None and stop in tokens:
            return tokens[: tokens.index(stop) + 1]
        return tokens


def edge_only(
    runtime: DraftRuntime, prompt_ids: Sequence[int], config: DecodeConfig
) -> Iterator[int]:
    """Decode with the draft alone (no network): its own greedy or top-k sampled tokens."""
    sampler = DraftSampler(config.temperature, config.draft_top_k, config.seed)
    runtime.reset()
    logits = runtime.extend(list(prompt_ids))
    for produced in range(config.max_new_tokens):
        token, _, _ = sampler.choose(logits)
        yield token
        if token == config.stop_token_id or produced + 1 == config.max_new_tokens:
            return
        if runtime.length + 1 > runtime.max_context:
            return
        logits = runtime.extend([token])
