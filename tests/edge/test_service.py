"""The verifier over real gRPC on 127.0.0.1: sessions, streaming, status codes, health, auth, TLS, metrics, LoRA."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient, VerifierUnreachable
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.proto.streams import reply_tokens
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import (
    BackgroundServer,
    ServerConfig,
    VerifierServer,
    load_verifier_model,
)
from fedge.simulations.local_services import self_signed_cert
from fedge.zoo import ZooPaths


def greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy continuation."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def code_of(call: object) -> grpc.StatusCode:
    """Run a zero-argument call expected to fail; return its status code."""
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    return caught.value.code()  # type: ignore[attr-defined,no-any-return]


def given_up_on(call: object) -> grpc.StatusCode:
    """Run a zero-argument call expected to give up (VerifierUnreachable, after the client's
    retries of a transient failure); return the status it gave up on."""
    with pytest.raises(VerifierUnreachable) as caught:
        call()  # type: ignore[operator]
    assert isinstance(caught.value.__cause__, grpc.RpcError)
    return caught.value.__cause__.code()  # type: ignore[attr-defined,no-any-return]


def health_status(port: int, root_cert: bytes | None = None) -> int:
    """Overall health status of the server on `port`."""
    channel = (
        grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root_cert))
        if root_cert
        else grpc.insecure_channel(f"127.0.0.1:{port}")
    )
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


def test_sessions_and_stream_over_grpc(
    verifier_port: int,
    micro_target: PreTrainedModel,
    micro_draft: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    with VerifierClient(ClientConfig(f"127.0.0.1:{verifier_port}")) as client:
        prompt = micro_prompts[7]
        info = client.open(prompt)
        assert (info.vocab_size, info.max_draft) == (1024, 8)
        expected = greedy(micro_target, prompt, 12)
        result = client.verify(info.session_id, expected[:3])  # the target's own tokens: all kept
        assert (result.accepted, result.next_token) == (3, expected[3])
        assert result.session_length == len(prompt) + 4
        assert client.close(info.session_id) == len(prompt) + 4
        assert list(client.generate(prompt, 12)) == expected
        assert client.bytes_up > 0 and client.bytes_down > 0
        edge = EdgeClient(
            TorchDraftRuntime(micro_draft), None, client, DecodeConfig(max_new_tokens=12)
        )
        assert [t for chunk in edge.stream_ids(prompt) for t in chunk] == expected
        assert edge.last is not None and edge.last.route == "speculative"
        assert [
            t for chunk in edge.stream_ids(prompt, route="cloud-only") for t in chunk
        ] == expected


def test_generate_batches_tokens_only_for_callers_that_ask(
    verifier_port: int, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """With batch_tokens a reply carries every token gathered since the last (the first waits for
    none: under load it may already carry two); without it, as older clients expect, one token
    per reply. Both are the target's greedy."""
    prompt, n = micro_prompts[3], 120
    expected = micro_target.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )[0, len(prompt) :].tolist()
    stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{verifier_port}"))

    def replies(batch: bool) -> list[pb.GenerateReply]:
        request = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=n, batch_tokens=batch)
        return list(stub.Generate(request, timeout=30))

    batched, single = replies(True), replies(False)
    assert [t for r in batched for t in reply_tokens(r)] == expected
    assert len(batched) < n // 4  # the micro target makes a token in ~1 ms; replies hold ~20 ms
    assert [r.token_id for r in single] == expected
    assert not any(r.more_token_ids for r in single)
    with VerifierClient(ClientConfig(f"127.0.0.1:{verifier_port}")) as client:
        chunks = list(client.generate_chunks(prompt, n))
    assert [t for c in chunks for t in c] == expected and len(chunks) < n // 4


def test_bad_input_maps_to_status_codes_and_server_survives(verifier_port: int) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{verifier_port}")
    stub = pb_grpc.VerifierStub(channel)
    sid = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 2, 3])).session_id
    verify = lambda **kw: stub.Verify(pb.VerifyRequest(**kw))  # noqa: E731
    assert code_of(lambda: verify(session_id="nope", draft_ids=[1])) == grpc.StatusCode.NOT_FOUND
    assert (
        code_of(lambda: verify(session_id=sid, draft_ids=[1024]))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code_of(lambda: verify(session_id=sid, draft_ids=[1] * 9))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    long_prompt = pb.OpenSessionRequest(prompt_ids=[1] * 600)
    assert code_of(lambda: stub.OpenSession(long_prompt)) == grpc.StatusCode.INVALID_ARGUMENT
    bad_stream = pb.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=0)
    assert code_of(lambda: list(stub.Generate(bad_stream))) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as caught:
        verify(session_id=sid, draft_ids=[-3])
    assert "draft_ids" in caught.value.details()  # type: ignore[attr-defined]
    assert stub.Verify(pb.VerifyRequest(session_id=sid, draft_ids=[4])).session_length >= 4
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert (
        code_of(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=sid)))
        == grpc.StatusCode.NOT_FOUND
    )
    channel.close()


def test_memory_cap_is_resource_exhausted(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel
) -> None:
    config = ServerConfig(
        micro_zoo.target_dir, drain_notice_s=0.0, engine=EngineConfig(kv_cap_bytes=1024)
    )
    with (
        BackgroundServer(config, micro_target) as server,
        VerifierClient(
            ClientConfig(f"127.0.0.1:{server.port}", max_retries=2, backoff_s=0.001)
        ) as client,
    ):
        assert (
            code_of(lambda: client.open(list(range(1, 50)))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert client.calls == 3  # the client backed off and retried twice


def test_bearer_token_tls_and_metrics(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, tmp_path: Path
) -> None:
    cert, key = self_signed_cert(tmp_path)
    config = ServerConfig(
        micro_zoo.target_dir,
        token="s3cret",
        tls_cert=cert,
        tls_key=key,
        metrics_port=0,
        drain_notice_s=0.0,
    )
    with BackgroundServer(config, micro_target) as server:
        target = f"127.0.0.1:{server.port}"
        good = VerifierClient(
            ClientConfig(target, token="s3cret", root_cert=cert, tls_server_name="localhost")
        )
        info = good.open([1, 2, 3])
        good.verify(info.session_id, [4, 5])
        wrong = VerifierClient(
            ClientConfig(target, token="guess", root_cert=cert, tls_server_name="localhost")
        )
        missing = VerifierClient(ClientConfig(target, root_cert=cert, tls_server_name="localhost"))
        assert code_of(lambda: wrong.open([1])) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: list(missing.generate([1], 2))) == grpc.StatusCode.UNAUTHENTICATED
        plain = VerifierClient(
            ClientConfig(target, token="s3cret", timeout_s=2, unreachable_after_s=0)
        )
        assert given_up_on(lambda: plain.open([1])) == grpc.StatusCode.UNAVAILABLE  # no TLS
        assert good.ping() > 0  # health needs no token
        assert server.server is not None and server.server.metrics_port
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics")
            .read()
            .decode()
        )
        assert 'fedge_verifier_requests_total{code="OK",method="Verify"} 1.0' in text
        assert "fedge_verifier_batch_size_count 1.0" in text
        assert "fedge_verifier_accepted_tokens_count 1.0" in text
        assert "fedge_verifier_sessions 1.0" in text
        for client in (good, wrong, missing, plain):
            client.close_channel()


def test_health_not_serving_while_loading_and_draining(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel
) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)  # noqa: E731
    config = ServerConfig(micro_zoo.target_dir, drain_notice_s=1.5, grace_s=0.5)

    async def build() -> VerifierServer:
        return VerifierServer(config)  # a grpc.aio server belongs to the loop that builds it

    server = run(build())
    try:
        port = run(server.listen())
        assert health_status(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        loading = ClientConfig(f"127.0.0.1:{port}", timeout_s=5, unreachable_after_s=0)
        with VerifierClient(loading) as client:
            assert given_up_on(lambda: client.open([1])) == grpc.StatusCode.UNAVAILABLE
            run(server.load(micro_target))
            assert health_status(port) == health_pb2.HealthCheckResponse.SERVING
            sid = client.open([1, 2]).session_id
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=30
                )
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
                stopping = asyncio.run_coroutine_threadsafe(server.stop(), loop)
                # the drain begins: the next status the server sends is NOT_SERVING
                assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
            client.verify(sid, [3])  # still served during the drain notice
            stopping.result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def test_lora_adapter_is_merged_at_load(
    micro_zoo: ZooPaths,
    micro_target: PreTrainedModel,
    lora_adapter: Path,
    micro_prompts: list[list[int]],
) -> None:
    merged = load_verifier_model(micro_zoo.target_dir, lora_adapter)
    prompts = micro_prompts[6:10]
    assert any(greedy(merged, p, 8) != greedy(micro_target, p, 8) for p in prompts)
    config = ServerConfig(micro_zoo.target_dir, adapter_dir=lora_adapter, drain_notice_s=0.0)
    with (
        BackgroundServer(config) as server,
        VerifierClient(ClientConfig(f"127.0.0.1:{server.port}")) as client,
    ):
        for prompt in prompts:
            assert list(client.generate(prompt, 8)) == greedy(merged, prompt, 8)
    with pytest.raises(FileNotFoundError, match=r"adapter_config.json"):
        load_verifier_model(micro_zoo.target_dir, micro_zoo.draft_dir)


def test_server_config_names_the_bad_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tls_cert and tls_key must be given together"):
        ServerConfig(tmp_path, tls_cert=tmp_path / "c.pem")
    with pytest.raises(ValueError, match=r"ServerConfig.port"):
        ServerConfig(tmp_path, port=70000)
    with pytest.raises(ValueError, match=r"ClientConfig.target must be HOST:PORT"):
        ClientConfig("localhost")


def test_sampling_over_grpc_is_reproducible_per_seed(
    verifier_port: int, micro_draft: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """Draft distributions travel in the proto; the same seeds give the same sampled text.

    The draft length is fixed: the objective's length follows measured times, and each length
    draws a different number of random numbers per round."""
    runs = []
    for _ in range(2):
        with VerifierClient(ClientConfig(f"127.0.0.1:{verifier_port}")) as client:
            config = DecodeConfig(
                max_new_tokens=16, temperature=0.8, seed=5, draft_top_k=8, adaptive=False
            )
            decoder = SpeculativeDecoder(TorchDraftRuntime(micro_draft), client, config)
            runs.append(decoder.generate(micro_prompts[3]))
            assert decoder.stats.drafted > 0 and client.bytes_up > 0
    assert runs[0] == runs[1] and len(runs[0]) == 16
