"""Batching engine without gRPC: greedy equality, batching, sessions' limits, bad input."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from fedge.edge.decoder import DecodeConfig, DraftSampler, SpeculativeDecoder, top_probability
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig, Sampling, VerifierEngine
from fedge.edge.verifier.errors import InvalidRequest, Overloaded, SessionBusy, SessionNotFound

NEW_TOKENS = 24


def target_greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy generation (transformers generate, no sampling)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture()
def engine(micro_target: PreTrainedModel):  # type: ignore[no-untyped-def]
    engine = VerifierEngine(micro_target, EngineConfig(max_draft=8, max_context=128)).start()
    yield engine
    engine.stop()


def test_greedy_speculative_equals_target_greedy_on_many_prompts(
    engine: VerifierEngine,
    micro_target: PreTrainedModel,
    micro_draft: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    """24 held-out prompts of 1..60 tokens, draft lengths 1..8 adapting: token-for-token equal."""
    runtime = TorchDraftRuntime(micro_draft)
    for i, prompt in enumerate(micro_prompts):
        # Prepare
        config = DecodeConfig(max_new_tokens=NEW_TOKENS, draft_len=1 + i % 4, max_draft=8)
        decoder = SpeculativeDecoder(runtime, engine, config)
        # Execute
        produced = decoder.generate(prompt)
        # Assert
        assert produced == target_greedy(micro_target, prompt, NEW_TOKENS), f"prompt {i}"
        assert decoder.stats.tokens == NEW_TOKENS
        assert decoder.stats.rounds <= NEW_TOKENS


def test_perfect_draft_is_fully_accepted(
    engine: VerifierEngine, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """With the target as its own draft every token is accepted: k+1 tokens per pass."""
    decoder = SpeculativeDecoder(
        TorchDraftRuntime(micro_target),
        engine,
        DecodeConfig(max_new_tokens=20, draft_len=4, adaptive=False, confidence_floor=0.0),
    )
    produced = decoder.generate(micro_prompts[5])
    assert produced == target_greedy(micro_target, micro_prompts[5], 20)
    assert decoder.stats.acceptance == 1.0
    assert decoder.stats.rounds == 4  # 20 tokens at 5 per pass


def test_an_unsure_draft_stops_drafting_early_and_stays_exact(
    engine: VerifierEngine, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """The target as its own draft, asked for 4 a round: every token is accepted, but the micro
    target is unsure of most, so a confidence floor above its top probabilities drafts one a
    round (`DecodeConfig.confidence_floor`: the first token is always drafted). Output stays
    the target's greedy continuation, and a floor of 0 drafts all 4."""
    runs = {}
    for floor in (0.0, 0.99):
        decoder = SpeculativeDecoder(
            TorchDraftRuntime(micro_target),
            engine,
            DecodeConfig(max_new_tokens=20, draft_len=4, adaptive=False, confidence_floor=floor),
        )
        assert decoder.generate(micro_prompts[5]) == target_greedy(
            micro_target, micro_prompts[5], 20
        )
        assert decoder.stats.acceptance == 1.0
        runs[floor] = decoder.stats.draft_lengths
    assert set(runs[0.0]) == {4}
    assert set(runs[0.99]) == {1}


def test_greedy_drafting_reports_the_drafts_top_probability() -> None:
    logits = np.array([2.0, 0.5, -1.0, 2.0 - math.log(3.0)], dtype=np.float32)
    token, _, dist = DraftSampler(0.0, 4, 0).choose(logits)
    assert token == 0 and dist == ([], [])
    assert top_probability(logits) == pytest.approx(
        np.exp(2.0) / np.exp(logits.astype(np.float64)).sum()
    )
    with pytest.raises(ValueError, match="confidence_floor"):
        DecodeConfig(confidence_floor=1.0)


def test_concurrent_sessions_are_batched_and_still_exact(
    micro_target: PreTrainedModel, micro_draft: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """8 sessions of different lengths verified concurrently: batches > 1, outputs unchanged."""
    sizes: list[int] = []

    class Recorder:
        def on_batch(self, size: int, seconds: float) -> None:
            sizes.append(size)

        def on_verify(self, drafted: int, accepted: int) -> None: ...

        def on_sessions(self, count: int, kv_bytes: int) -> None: ...

        def on_evict(self, reason: str) -> None: ...

    engine = VerifierEngine(
        micro_target,
        EngineConfig(max_draft=8, batch_window_s=0.01, max_batch=8),
        observer=Recorder(),
    ).start()
    prompts = micro_prompts[4:12]
    barrier = threading.Barrier(len(prompts))

    def run(prompt: list[int]) -> list[int]:
        decoder = SpeculativeDecoder(
            TorchDraftRuntime(micro_draft), engine, DecodeConfig(max_new_tokens=12, draft_len=3)
        )
        barrier.wait()
        return decoder.generate(prompt)

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, prompts))
    finally:
        engine.stop()
    for prompt, produced in zip(prompts, results, strict=True):
        assert produced == target_greedy(micro_target, prompt, 12)
    assert max(sizes) > 1


def test_bad_input_is_refused_with_the_field_named(engine: VerifierEngine) -> None:
    info = engine.open([5, 6, 7])
    with pytest.raises(InvalidRequest, match=r"draft_ids: id 5000 is outside"):
        engine.verify(info.session_id, [5000])
    with pytest.raises(InvalidRequest, match=r"exceed max_draft 8"):
        engine.verify(info.session_id, [1] * 9)
    with pytest.raises(InvalidRequest, match=r"prompt_ids: 128 tokens"):
        engine.open(list(range(128)))
    with pytest.raises(InvalidRequest, match=r"prompt_ids: 0 tokens"):
        engine.open([])
    with pytest.raises(InvalidRequest, match=r"sampling.temperature"):
        engine.open([1], Sampling(temperature=-1.0))
    with pytest.raises(SessionNotFound):
        engine.verify("no-such-session", [1])
    engine.close(info.session_id)
    with pytest.raises(SessionNotFound):
        engine.verify(info.session_id, [1])


def test_session_cannot_grow_past_the_context(engine: VerifierEngine) -> None:
    info = engine.open(list(range(1, 121)))  # 120 of 128 positions
    engine.verify(info.session_id, [1, 2, 3])  # up to 124 tokens
    with pytest.raises(InvalidRequest, match=r"pass max_context 128"):
        engine.verify(info.session_id, [1] * 8)


def test_sampling_needs_draft_distributions(engine: VerifierEngine) -> None:
    info = engine.open([3, 4], Sampling(temperature=1.0, seed=3))
    with pytest.raises(InvalidRequest, match=r"draft_probs"):
        engine.verify(info.session_id, [7])
    with pytest.raises(InvalidRequest, match=r"draft_dists\[0\].probs"):
        engine.verify(info.session_id, [7], [0.5], [([7, 8], [0.5, 0.2])])
    with pytest.raises(InvalidRequest, match=r"differs from draft_dists"):
        engine.verify(info.session_id, [7], [0.9], [([7, 8], [0.5, 0.5])])
    result = engine.verify(info.session_id, [7], [0.5], [([7, 8], [0.5, 0.5])])
    assert result.session_length == 2 + result.accepted + 1


def test_second_verify_in_flight_is_refused(
    micro_target: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the target's forward pass waits on a gate, so the first verify stays in flight
    # until the test opens it (no timing involved)
    engine = VerifierEngine(micro_target, EngineConfig(max_batch=4)).start()
    gate, forward = threading.Event(), micro_target.forward
    entered = threading.Event()

    def gated(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        return forward(*args, **kwargs)

    try:
        info = engine.open([1, 2])
        monkeypatch.setattr(micro_target, "forward", gated)
        first = engine.submit_verify(info.session_id, [3])
        assert entered.wait(30)  # the worker holds the first verify in its forward pass
        # Execute / Assert
        with pytest.raises(SessionBusy, match=r"in flight"):
            engine.submit_verify(info.session_id, [3])
        gate.set()
        assert first.result(timeout=30).session_length >= 3
        engine.verify(info.session_id, [])  # free again once answered
    finally:
        gate.set()
        engine.stop()


def test_full_queue_is_backpressure(micro_target: PreTrainedModel) -> None:
    # Prepare: a stand-in worker that never consumes, so the bounded queue fills deterministically
    engine = VerifierEngine(micro_target, EngineConfig(max_queue=2))
    release = threading.Event()
    engine._thread = threading.Thread(target=release.wait, daemon=True)
    engine._thread.start()
    try:
        engine.submit_open([1], Sampling())
        engine.submit_open([2], Sampling())
        with pytest.raises(Overloaded, match=r"queue is full"):
            engine.submit_open([3], Sampling())
    finally:
        release.set()


def test_sessions_expire_after_the_ttl(micro_target: PreTrainedModel) -> None:
    now = [0.0]
    engine = VerifierEngine(
        micro_target, EngineConfig(session_ttl_s=10.0), clock=lambda: now[0]
    ).start()
    try:
        old = engine.open([1, 2, 3]).session_id
        now[0] = 5.0
        engine.verify(old, [4])  # use refreshes it
        now[0] = 14.0
        fresh = engine.open([1]).session_id
        now[0] = 15.5  # old idle since 5.0: expired; fresh idle since 14.0: alive
        with pytest.raises(SessionNotFound, match=r"expired"):
            engine.verify(old, [1])
        engine.verify(fresh, [1])
    finally:
        engine.stop()


def test_lru_eviction_under_session_and_memory_caps(micro_target: PreTrainedModel) -> None:
    engine = VerifierEngine(micro_target, EngineConfig(max_sessions=2)).start()
    try:
        a = engine.open([1, 2]).session_id
        b = engine.open([1, 2]).session_id
        engine.verify(a, [3])  # a is now the most recently used
        c = engine.open([1, 2]).session_id  # evicts b
        with pytest.raises(SessionNotFound):
            engine.verify(b, [1])
        engine.verify(a, [1])
        engine.verify(c, [1])
    finally:
        engine.stop()
    per_token = VerifierEngine(micro_target).bytes_per_position
    capped = VerifierEngine(micro_target, EngineConfig(kv_cap_bytes=40 * per_token)).start()
    try:
        first = capped.open(list(range(1, 21))).session_id  # 19 positions cached
        second = capped.open(list(range(1, 21))).session_id  # 38 positions: fits
        capped.open(list(range(1, 11)))  # needs room: evicts the LRU (first)
        with pytest.raises(SessionNotFound):
            capped.verify(first, [1])
        capped.verify(second, [1])
        with pytest.raises(Overloaded, match=r"memory cap"):
            capped.open(list(range(1, 60)))  # larger than the whole cap
    finally:
        capped.stop()


def test_engine_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.max_batch must be > 0, got 0"):
        EngineConfig(max_batch=0)
    with pytest.raises(ValueError, match=r"batch_window_s"):
        EngineConfig(batch_window_s=-1)
