"""Per-device rate limits: the bucket's arithmetic, then over a real gRPC verifier on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, EdgeClient, RateLimited, VerifierClient
from fedge.edge.decoder import DecodeConfig
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.limits import (
    DEVICE_KEY,
    RETRY_AFTER_KEY,
    DeviceBuckets,
    RateLimitConfig,
    device_of,
    retry_after_ms,
)
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths

MAX_DRAFT = 8  # so the longest verify costs 9 verify tokens


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------ the bucket alone
def test_bucket_spends_burst_then_refills_at_rate() -> None:
    clock = Clock()
    buckets = DeviceBuckets(rate=4.0, burst=10, max_devices=8, clock=clock)
    assert buckets.take("a", 10) == 0.0  # a new device starts full
    assert buckets.take("a", 2) == pytest.approx(0.5)  # 2 tokens at 4/s; nothing spent
    clock.now += 0.25  # +1 token
    assert buckets.take("a", 2) == pytest.approx(0.25)
    clock.now += 0.25
    assert buckets.take("a", 2) == 0.0
    clock.now += 60.0
    assert buckets.take("a", 11) == pytest.approx(0.25)  # refills only up to the burst
    assert buckets.take("b", 10) == 0.0  # another device has its own bucket


def test_refund_gives_back_unused_tokens_but_never_above_burst() -> None:
    clock = Clock()
    buckets = DeviceBuckets(rate=1.0, burst=10, max_devices=8, clock=clock)
    assert buckets.take("a", 10) == 0.0
    buckets.refund("a", 7)
    assert buckets.take("a", 7) == 0.0
    assert buckets.take("a", 1) == pytest.approx(1.0)
    buckets.refund("a", 50)
    assert buckets.take("a", 11) == pytest.approx(1.0)


def test_store_keeps_at_most_max_devices() -> None:
    clock = Clock()
    buckets = DeviceBuckets(rate=1.0, burst=5, max_devices=3, clock=clock)
    for device in ("a", "b", "c"):
        buckets.take(device, 5)
    buckets.take("a", 0)  # touch a: b is now the least recently used
    buckets.take("d", 5)
    assert len(buckets) == 3
    assert buckets.take("a", 1) > 0  # a kept its empty bucket
    assert buckets.take("b", 5) == 0.0  # b was dropped and starts full again


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"verify_rate": 0.0}, "verify_rate"),
        ({"generate_rate": float("nan")}, "generate_rate"),
        ({"verify_burst": 0}, "verify_burst"),
        ({"max_devices": 0}, "max_devices"),
    ],
)
def test_config_names_the_bad_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=f"RateLimitConfig.{field}"):
        RateLimitConfig(**kwargs)  # type: ignore[arg-type]


def test_server_refuses_a_verify_burst_below_the_longest_draft(micro_zoo: ZooPaths) -> None:
    with pytest.raises(ValueError, match="verify_burst=8 is below"):
        ServerConfig(
            micro_zoo.target_dir,
            engine=EngineConfig(max_draft=MAX_DRAFT),
            rate_limits=RateLimitConfig(verify_rate=1.0, verify_burst=MAX_DRAFT),
        )


def test_device_key_prefers_device_id_then_token_then_peer() -> None:
    assert device_of(
        [(DEVICE_KEY, "phone-1"), ("authorization", "Bearer s")], "ipv4:1.2.3.4:5"
    ) == ("device:phone-1")
    by_token = device_of([("authorization", "Bearer secret")], "ipv4:1.2.3.4:5")
    assert by_token.startswith("token:") and "secret" not in by_token
    assert device_of([], "ipv4:10.0.0.7:53412") == "peer:ipv4:10.0.0.7"
    assert retry_after_ms([(RETRY_AFTER_KEY, "250")]) == 250
    assert retry_after_ms([(RETRY_AFTER_KEY, "soon")]) is None


# ------------------------------------------------------------------------ over real gRPC
def _serve(
    micro_zoo: ZooPaths, model: PreTrainedModel, limits: RateLimitConfig
) -> BackgroundServer:
    config = ServerConfig(
        micro_zoo.target_dir,
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=MAX_DRAFT, batch_window_s=0.001),
        rate_limits=limits,
    )
    server = BackgroundServer(config, model)
    server.start()
    return server


@pytest.fixture(scope="module")
def strict_port(micro_zoo: ZooPaths, micro_target: PreTrainedModel) -> Iterator[int]:
    """1 token/s per device, so a spent bucket stays spent for the whole test."""
    limits = RateLimitConfig(
        verify_rate=1.0, verify_burst=MAX_DRAFT + 1, generate_rate=1.0, generate_burst=16
    )
    server = _serve(micro_zoo, micro_target, limits)
    yield server.port
    server.stop(grace_s=0.2)


def _client(port: int, device: str, **overrides: float) -> VerifierClient:
    options: dict[str, float] = {"max_retries": 0, "max_wait_s": 30.0, **overrides}
    return VerifierClient(ClientConfig(f"127.0.0.1:{port}", device_id=device, **options))  # type: ignore[arg-type]


def test_device_over_budget_is_refused_with_retry_after_and_others_are_not(
    strict_port: int, micro_prompts: list[list[int]]
) -> None:
    prompt = micro_prompts[5]
    with _client(strict_port, "greedy-phone") as phone, _client(strict_port, "other") as other:
        session = phone.open(prompt).session_id
        phone.verify(session, prompt[:MAX_DRAFT])  # 9 tokens: the whole burst
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{strict_port}"))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Verify(
                pb.VerifyRequest(session_id=session, draft_ids=prompt[:MAX_DRAFT]),
                metadata=((DEVICE_KEY, "greedy-phone"),),
                timeout=10,
            )
        error = refused.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert "rate limit" in error.details()  # type: ignore[attr-defined]
        wait_ms = retry_after_ms(error.trailing_metadata())  # type: ignore[attr-defined]
        assert wait_ms is not None and 5_000 < wait_ms <= 9_000  # ~9 tokens at 1/s
        other_session = other.open(prompt).session_id
        assert other.verify(other_session, prompt[:MAX_DRAFT]).session_length > len(prompt)
        with pytest.raises(RateLimited) as limited:  # the client waits at most 0.5 s
            _client(strict_port, "greedy-phone", max_wait_s=0.5).verify(session, [])
        assert 0.5 < limited.value.retry_after_s <= 1.0  # the empty verify costs one token
        with pytest.raises(RateLimited) as long_wait:
            _client(strict_port, "greedy-phone", max_wait_s=0.1).verify(session, prompt[:3])
        assert 2.0 < long_wait.value.retry_after_s <= 4.0


def test_client_waits_the_retry_after_and_succeeds(
    strict_port: int, micro_prompts: list[list[int]]
) -> None:
    prompt = micro_prompts[6]
    with _client(strict_port, "patient-phone", max_retries=2, max_wait_s=2.0) as phone:
        session = phone.open(prompt).session_id
        phone.verify(session, prompt[:MAX_DRAFT])
        result = phone.verify(session, [])  # one token: refused, waits <= 1 s, then served
        assert phone.rate_limited_waits == 1
        assert result.session_length == len(prompt) + 2


def test_generate_pays_up_front_and_gets_unused_tokens_back(
    strict_port: int, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    prompt = micro_prompts[8]
    expected = micro_target.generate(
        torch.tensor([prompt]), max_new_tokens=3, min_new_tokens=3, do_sample=False
    )[0, len(prompt) :].tolist()
    with _client(strict_port, "streamer") as phone:
        with pytest.raises(grpc.RpcError) as too_big:
            list(phone.generate(prompt, 17))
        assert too_big.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "max_new_tokens" in too_big.value.details()  # type: ignore[attr-defined]
        tokens = list(phone.generate(prompt, 16, stop_token_id=expected[2]))  # charged 16
        assert tokens[-1] == expected[2] and len(tokens) <= 3  # ... 13 or more refunded
        assert len(list(phone.generate(prompt, 12))) == 12  # served from the refund
        with pytest.raises(RateLimited):
            list(_client(strict_port, "streamer", max_wait_s=2.0).generate(prompt, 12))


def test_a_batched_stream_pays_for_every_token_it_carries(
    strict_port: int, micro_prompts: list[list[int]]
) -> None:
    """Replies carrying several tokens (batch_tokens) are metered per token, not per reply.

    Counting replies, a 16-token stream sent in 2-3 replies refunded 13-14 of the 16 tokens it
    was charged, so the same device streamed 16 more at once: well past its 1 token/s.
    """
    prompt = micro_prompts[8]
    stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{strict_port}"))
    metadata = ((DEVICE_KEY, "batching-phone"),)
    replies = list(
        stub.Generate(
            pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=16, batch_tokens=True),
            metadata=metadata,
            timeout=30,
        )
    )
    assert sum(1 + len(r.more_token_ids) for r in replies) == 16
    assert len(replies) < 16  # several tokens per reply, or this test proves nothing
    with pytest.raises(grpc.RpcError) as refused:
        list(
            stub.Generate(
                pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=8, batch_tokens=True),
                metadata=metadata,
                timeout=30,
            )
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]


def test_edge_client_takes_the_device_route_while_rate_limited(
    strict_port: int, micro_draft: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    prompt = micro_prompts[9]
    client = _client(strict_port, "busy-phone", max_wait_s=0.5)
    list(client.generate(prompt, 16))  # spend the whole Generate budget
    edge = EdgeClient(TorchDraftRuntime(micro_draft), None, client, DecodeConfig(max_new_tokens=6))
    tokens = [t for chunk in edge.stream_ids(prompt, route="cloud-only") for t in chunk]
    assert edge.last is not None and edge.last.route == "edge-only"
    assert "rate limit" in edge.last.reason and len(tokens) == 6
    calls = client.calls
    list(edge.stream_ids(prompt, route="cloud-only"))  # still inside the retry-after
    assert edge.last.route == "edge-only" and client.calls == calls
    client.close_channel()


def test_speculative_decoding_under_a_rate_limit_waits_and_stays_exact(
    micro_zoo: ZooPaths,
    micro_target: PreTrainedModel,
    micro_draft: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    """20 verify tokens/s: 16 tokens need more verify tokens than the burst, so the client waits."""
    server = _serve(
        micro_zoo, micro_target, RateLimitConfig(verify_rate=20.0, verify_burst=MAX_DRAFT + 1)
    )
    prompt = micro_prompts[10]
    expected = micro_target.generate(
        torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False
    )[0, len(prompt) :].tolist()
    try:
        with _client(server.port, "spec-phone", max_retries=20, max_wait_s=2.0) as client:
            decode = DecodeConfig(max_new_tokens=16, draft_len=MAX_DRAFT, max_draft=MAX_DRAFT)
            edge = EdgeClient(TorchDraftRuntime(micro_draft), None, client, decode)
            tokens = [t for chunk in edge.stream_ids(prompt, route="speculative") for t in chunk]
            assert tokens == expected
            assert client.rate_limited_waits >= 1
    finally:
        server.stop(grace_s=0.2)
