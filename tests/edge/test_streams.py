"""Cloud-only Generate streams in the engine: exact, batched with newcomers, cancellable, bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from transformers import PreTrainedModel

from fedge.edge.verifier.engine import EngineConfig, Sampling, VerifierEngine
from fedge.edge.verifier.errors import NotReady, Overloaded
from tests.edge.test_engine import target_greedy
from tests.edge.test_liveness import poll

LONG = 200  # tokens; a stream this long runs ~0.4 s on the micro target, a cancelled one far less


@pytest.fixture()
def engine(micro_target: PreTrainedModel) -> Iterator[VerifierEngine]:
    """A private engine, so that session counts and streams are this test's own."""
    engine = VerifierEngine(micro_target, EngineConfig(max_draft=8)).start()
    yield engine
    engine.stop()


def test_lone_and_concurrent_streams_equal_plain_greedy(
    engine: VerifierEngine, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """One stream alone, then three at once (batched), each token-for-token the target's greedy."""
    # Prepare
    prompts = [micro_prompts[i] for i in (0, 4, 8)]  # 1, 8 and 60 tokens
    expected = [target_greedy(micro_target, p, 32) for p in prompts]
    # Execute
    alone = list(engine.submit_generate(prompts[2], 32, Sampling()))
    channels = [engine.submit_generate(p, 32, Sampling()) for p in prompts]
    together = [list(channel) for channel in channels]
    # Assert
    assert alone == expected[2]
    assert together == expected
    poll(lambda: len(engine.sessions) == 0, 5, "finished streams to free their sessions")


def test_a_newcomer_joins_a_running_stream_at_its_next_step(
    engine: VerifierEngine, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """An open and a verify arriving mid-stream are answered long before the stream ends."""
    # Prepare
    prompt = micro_prompts[1]
    stream = engine.submit_generate(prompt, LONG, Sampling())
    first = next(stream.chunks(timeout_s=10))
    # Execute: the worker is in its tight loop; these must not wait for the stream to end
    info = engine.open(micro_prompts[3])
    result = engine.verify(info.session_id, [7, 8])
    produced_meanwhile = stream.produced
    rest = [token for chunk in stream.chunks(timeout_s=10) for token in chunk]
    # Assert
    assert result.session_length >= len(micro_prompts[3]) + 1
    assert produced_meanwhile < LONG, "the verify waited for the whole stream"
    assert first + rest == target_greedy(micro_target, prompt, LONG)


def test_cancel_during_the_tight_loop_frees_the_session_at_once(
    engine: VerifierEngine, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """A reader that leaves after 2 tokens stops the decoding within a few steps, not at the end."""
    # Prepare
    stream = engine.submit_generate(micro_prompts[1], LONG, Sampling())
    chunks = stream.chunks(timeout_s=10)
    next(chunks)
    # Execute
    stream.cancel()
    # Assert
    poll(lambda: len(engine.sessions) == 0, 5, "the cancelled stream's session to be freed")
    assert stream.produced < LONG // 2, "the worker decoded on for a reader that had gone"
    assert list(engine.submit_generate(micro_prompts[2], 8, Sampling())) == target_greedy(
        micro_target, micro_prompts[2], 8
    )


def test_stop_token_ends_the_stream_and_sampling_is_reproducible_per_seed(
    engine: VerifierEngine, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """The stop token is sent, then the stream ends; a seeded sampled stream repeats exactly."""
    greedy = target_greedy(micro_target, micro_prompts[5], 16)
    stopped = list(engine.submit_generate(micro_prompts[5], 16, Sampling(), greedy[3]))
    assert stopped == greedy[: greedy.index(greedy[3]) + 1]
    sampled = [
        list(engine.submit_generate(micro_prompts[5], 16, Sampling(temperature=1.0, seed=7)))
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 16


def test_a_stream_past_the_memory_cap_fails_alone(
    micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """A stream that outgrows the KV cap ends RESOURCE_EXHAUSTED; the worker serves on."""
    per_position = VerifierEngine(micro_target).bytes_per_position
    engine = VerifierEngine(micro_target, EngineConfig(kv_cap_bytes=40 * per_position)).start()
    try:
        stream = engine.submit_generate(micro_prompts[3], 100, Sampling())
        with pytest.raises(Overloaded, match=r"memory cap"):
            list(stream)
        assert 30 < stream.produced < 40  # it ran until the cap, then stopped
        assert len(engine.sessions) == 0
        assert len(list(engine.submit_generate(micro_prompts[3], 8, Sampling()))) == 8
    finally:
        engine.stop()


def test_stopping_the_engine_ends_running_streams(
    micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """A stream running when the engine stops ends with NotReady instead of hanging its reader."""
    engine = VerifierEngine(micro_target).start()
    stream = engine.submit_generate(micro_prompts[1], LONG, Sampling())
    chunks = stream.chunks(timeout_s=10)
    next(chunks)
    started = time.monotonic()
    engine.stop()
    with pytest.raises(NotReady, match=r"shutting down"):
        for _ in chunks:
            pass
    assert time.monotonic() - started < 5
