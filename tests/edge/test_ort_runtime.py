"""The verifier's target on ONNX Runtime: lossless against torch, batched, re-exported per adapter.

Real ONNX Runtime sessions on the micro target's export (cached under FEDGE_HOME by the
weights' digest: the first run exports, later runs reuse it) and real verifiers on 127.0.0.1.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import PreTrainedModel
from typer.testing import CliRunner

from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient
from fedge.edge.decoder import DecodeConfig
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.batching import KVGeometry, batched_forward
from fedge.edge.verifier.engine import EngineConfig, Sampling, VerifierEngine
from fedge.edge.verifier.ort import OrtKV, OrtRuntime, target_export, weights_digest
from fedge.edge.verifier.runtime import TorchRuntime
from fedge.edge.verifier.server import BackgroundServer, ServerConfig, load_verifier_model
from fedge.zoo import ZooPaths
from tests.edge.harness import write_credentials
from tests.edge.test_engine import target_greedy

PER_POSITION = (
    1024  # KV bytes of one micro-target position: 2 layers x (K, V) x 2 heads x 32 x fp32
)


@pytest.fixture(scope="module")
def ort_runtime(micro_target: PreTrainedModel) -> OrtRuntime:
    """The micro target's ONNX runtime (exported once per weights, then read from the cache)."""
    return OrtRuntime(target_export(micro_target), threads=1)


@pytest.fixture(scope="module")
def ort_port(micro_zoo: ZooPaths, micro_target: PreTrainedModel) -> Iterator[int]:
    """A live verifier serving the micro target on ONNX Runtime."""
    config = ServerConfig(
        micro_zoo.target_dir,
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=8, batch_window_s=0.002, runtime="onnx"),
    )
    with BackgroundServer(config, micro_target) as server:
        assert server.server is not None and server.server.engine is not None
        assert isinstance(server.server.engine.runtime, OrtRuntime)  # no silent fallback
        yield server.port


def test_padded_batch_of_different_lengths_matches_torch(
    ort_runtime: OrtRuntime, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """Three sessions of 0, 7 and 59 cached positions with 1, 3 and 5 new tokens in one padded
    pass: logits and new KV equal torch's padded pass on the same sessions."""
    # Prepare
    torch_rt = TorchRuntime(micro_target, KVGeometry.of(micro_target))
    pasts = [[], micro_prompts[4][:7], micro_prompts[8][:59]]
    inputs = [[11], [12, 13, 14], [15, 16, 17, 18, 19]]
    with torch.inference_mode():
        torch_caches = [torch_rt.prefill(p)[0] for p in pasts]
        ort_caches = [ort_runtime.prefill(p)[0] for p in pasts]
        # Execute
        want_logits, want_kv = batched_forward(
            micro_target, torch_rt.geometry, torch_caches, inputs
        )
        got_logits, got_kv = ort_runtime.batched_forward(ort_caches, inputs)
    # Assert
    for row, tokens in enumerate(inputs):
        real = len(tokens)  # the right padding's logits are not read
        torch.testing.assert_close(
            got_logits[row, :real], want_logits[row, :real], atol=1e-4, rtol=1e-4
        )
        assert got_logits[row, :real].argmax(-1).tolist() == (
            want_logits[row, :real].argmax(-1).tolist()
        )
        for (gk, gv), (wk, wv) in zip(got_kv, want_kv, strict=True):
            torch.testing.assert_close(gk[row, :, :real], wk[row, :, :real], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gv[row, :, :real], wv[row, :, :real], atol=1e-4, rtol=1e-4)
    assert [c.get_seq_length() for c in ort_caches] == [0, 7, 59]  # caches untouched


def test_cloud_only_and_speculative_over_grpc_equal_the_torch_verifier(
    ort_port: int,
    verifier_port: int,
    micro_draft: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    """Generate and speculative decoding through the ONNX verifier give, token for token, what
    the torch verifier gives, for prompts of 1 to 60 tokens."""
    prompts = [micro_prompts[i] for i in (0, 3, 6, 8, 13)]
    with (
        VerifierClient(ClientConfig(f"127.0.0.1:{ort_port}")) as onnx_client,
        VerifierClient(ClientConfig(f"127.0.0.1:{verifier_port}")) as torch_client,
    ):
        draft = TorchDraftRuntime(micro_draft)
        config = DecodeConfig(max_new_tokens=16, draft_len=4, max_draft=8)
        for prompt in prompts:
            expected = list(torch_client.generate(prompt, 16))
            assert list(onnx_client.generate(prompt, 16)) == expected
            edge = EdgeClient(draft, None, onnx_client, config)
            assert [t for chunk in edge.stream_ids(prompt) for t in chunk] == expected
            assert edge.last is not None and edge.last.route == "speculative"


def test_concurrent_streams_and_verifies_batch_and_stay_exact(
    micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """Three Generate streams at once and four sessions verifying from threads share padded
    passes (batches of more than one are seen) and each equals the target's own greedy."""
    # Prepare
    sizes: list[int] = []

    class Batches:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return lambda *args, **kwargs: None

        def on_batch(self, size: int, seconds: float) -> None:
            sizes.append(size)

    engine = VerifierEngine(
        micro_target, EngineConfig(max_draft=8, runtime="onnx"), observer=Batches()
    ).start()
    try:
        assert isinstance(engine.runtime, OrtRuntime)
        prompts = [micro_prompts[i] for i in (0, 4, 8)]
        expected = [target_greedy(micro_target, p, 24) for p in prompts]
        # Execute: streams
        channels = [engine.submit_generate(p, 24, Sampling()) for p in prompts]
        together = [list(channel) for channel in channels]
        # Execute: verifies of the target's own continuation, 3 tokens a round, from threads
        verified: dict[int, list[int]] = {}

        def verify_loop(index: int) -> None:
            prompt = micro_prompts[index]
            want = target_greedy(micro_target, prompt, 12)
            info = engine.open(prompt)
            got: list[int] = []
            while len(got) < 12:
                draft = want[len(got) : len(got) + 3]
                result = engine.verify(info.session_id, draft)
                got += [*draft[: result.accepted], result.next_token]
            verified[index] = got[:12]
            engine.close(info.session_id)

        threads = [threading.Thread(target=verify_loop, args=(i,)) for i in (1, 5, 9, 12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        # Assert
        assert together == expected
        for index, got in verified.items():
            assert got == target_greedy(micro_target, micro_prompts[index], 12)
        assert len(verified) == 4
        assert max(sizes) > 1, "no padded batch ran"
    finally:
        engine.stop()


def test_a_new_adapter_is_exported_anew_and_served_merged(
    micro_zoo: ZooPaths,
    micro_target: PreTrainedModel,
    lora_adapter: Path,
    micro_prompts: list[list[int]],
) -> None:
    """The merged adapter's weights hash to another digest, hence another export, and the ONNX
    verifier serving base plus adapter decodes as the merged torch model (not as the base)."""
    # Prepare
    merged = load_verifier_model(micro_zoo.target_dir, lora_adapter)
    prompts = micro_prompts[6:10]
    # Execute
    base_dir, merged_dir = target_export(micro_target), target_export(merged)
    config = ServerConfig(
        micro_zoo.target_dir,
        adapter_dir=lora_adapter,
        drain_notice_s=0.0,
        engine=EngineConfig(runtime="onnx"),
    )
    with (
        BackgroundServer(config) as server,
        VerifierClient(ClientConfig(f"127.0.0.1:{server.port}")) as client,
    ):
        assert server.server is not None and server.server.engine is not None
        served = server.server.engine.runtime
        got = [list(client.generate(p, 8)) for p in prompts]
    # Assert
    assert weights_digest(merged) != weights_digest(micro_target)
    assert base_dir != merged_dir
    assert isinstance(served, OrtRuntime) and served.export == merged_dir
    assert got == [target_greedy(merged, p, 8) for p in prompts]
    assert got != [target_greedy(micro_target, p, 8) for p in prompts]


def test_bad_input_is_refused_by_name_and_the_onnx_verifier_survives(ort_port: int) -> None:
    """Out-of-vocabulary drafts, too long drafts and prompts are INVALID_ARGUMENT naming the
    field; the session then verifies as before."""
    with grpc.insecure_channel(f"127.0.0.1:{ort_port}") as channel:
        stub = pb_grpc.VerifierStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 2, 3])).session_id
        for request in (
            pb.VerifyRequest(session_id=sid, draft_ids=[1024]),
            pb.VerifyRequest(session_id=sid, draft_ids=[1] * 9),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Verify(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "draft_ids" in caught.value.details()  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as caught:
            stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[1] * 600))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert stub.Verify(pb.VerifyRequest(session_id=sid, draft_ids=[4])).session_length >= 4


def test_bad_runtime_options_are_refused_by_name() -> None:
    """An unknown runtime and ONNX with a ring are refused at configuration, naming the fields;
    the command line says the same before loading anything."""
    with pytest.raises(ValueError, match=r"EngineConfig.runtime must be one of"):
        EngineConfig(runtime="tensorrt")
    with pytest.raises(ValueError, match=r"runtime='onnx' cannot serve with ring_size=2"):
        EngineConfig(runtime="onnx", ring_size=2)
    assert EngineConfig(runtime="auto", ring_size=2).ring() is not None  # auto serves torch there
    from fedge.cli.main import app

    result = CliRunner().invoke(
        app, ["verifier", "serve", "--model", "nowhere", "--runtime", "onnx", "--ring-size", "2"]
    )
    assert result.exit_code != 0
    assert "cannot serve a ring" in result.output


def test_kv_accounting_and_fair_shares_hold_on_onnx(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, tmp_path: Path
) -> None:
    """Session KV is counted at 1,024 bytes a position on ONNX Runtime as on torch; a device's
    quota of 100 positions refuses bob's 200-token open on an empty cap, and his second 60-token
    open makes room among his own sessions while alice's passes beside him."""
    path, tokens = write_credentials(tmp_path, ["alice", "bob"])
    alice, bob = ((("authorization", f"Bearer {tokens[d]}"),) for d in ("alice", "bob"))
    engine_config = EngineConfig(
        max_draft=8,
        kv_cap_bytes=1 << 20,
        kv_cap_per_token_bytes=100 * PER_POSITION,
        runtime="onnx",
    )
    config = ServerConfig(
        micro_zoo.target_dir, credentials_file=path, drain_notice_s=0.0, engine=engine_config
    )
    with (
        BackgroundServer(config, micro_target) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        assert server.server is not None and server.server.engine is not None
        engine = server.server.engine
        stub = pb_grpc.VerifierStub(channel)
        big = pb.OpenSessionRequest(prompt_ids=[3 + i for i in range(200)])
        with pytest.raises(grpc.RpcError) as caught:
            stub.OpenSession(big, metadata=bob)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        small = pb.OpenSessionRequest(prompt_ids=[3 + i for i in range(60)])
        first = stub.OpenSession(small, metadata=bob).session_id
        assert engine.sessions.total_bytes == 59 * PER_POSITION  # the pending token has no KV yet
        stub.OpenSession(small, metadata=bob)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Verify(pb.VerifyRequest(session_id=first), metadata=bob)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        mine = stub.OpenSession(small, metadata=alice).session_id
        stub.Verify(pb.VerifyRequest(session_id=mine, draft_ids=[5, 6, 7]), metadata=alice)
        # bob's 59 positions; alice's pass computed 4 more, and the arrays of her cropped cache
        # keep all 63 alive until her next pass replaces them: counted, not hidden
        assert engine.sessions.total_bytes == (59 + 63) * PER_POSITION


def test_auto_times_both_runtimes_and_logs_the_figures(
    micro_target: PreTrainedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """`auto` measures a prefill and decode steps on torch and on ONNX Runtime, logs both, and
    serves the one it names."""
    with caplog.at_level(logging.INFO, logger="fedge.verifier"):
        engine = VerifierEngine(micro_target, EngineConfig(runtime="auto"))
    line = next(
        r.getMessage() for r in caplog.records if "verifier runtime auto:" in r.getMessage()
    )
    chosen = line.split("auto: ")[1].split(" ")[0]
    assert "torch " in line and "onnx " in line and " ms" in line
    assert isinstance(engine.runtime, OrtRuntime if chosen == "onnx" else TorchRuntime)


def test_a_cropped_cache_counts_the_memory_it_keeps_alive() -> None:
    """A crop leaves views of the longer arrays: they are counted until a pass replaces them."""
    import numpy as np

    cache = OrtKV([np.zeros((1, 2, 10, 4), dtype=np.float32) for _ in range(4)])
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    assert cache.nbytes == 4 * 10 * 2 * 4 * 4
    cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
    assert cache.arrays[0].shape[2] == 8 and cache.arrays[0][0, 0, -1, 0] == 1.0


@pytest.mark.pretrained
def test_smollm2_on_onnx_runtime_decodes_as_torch_through_the_verifier() -> None:
    """SmolLM2-135M (converted under FEDGE_HOME by `fedge models fetch smollm2-135m`) exported
    for the verifier: cloud-only Generate and a speculative session give the torch verifier's
    tokens, alone and with two streams batched together. Minutes: the first run exports."""
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.paths import fedge_home

    model_dir = fedge_home() / "models" / "smollm2-135m"
    if not (model_dir / "config.json").is_file():
        pytest.skip(f"{model_dir} is missing; run `fedge models fetch smollm2-135m`")
    model = load_causal_lm(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    prompts = [
        tokenizer(text)["input_ids"]
        for text in ("def add(a, b):\n", 'import os\n\ndef list_files(path):\n    """')
    ]
    expected = []
    for prompt in prompts:
        with torch.inference_mode():
            expected.append(target_greedy(model, prompt, 12))
    engine = VerifierEngine(model, EngineConfig(max_draft=8, runtime="onnx")).start()
    try:
        assert isinstance(engine.runtime, OrtRuntime)
        assert [list(engine.submit_generate(p, 12, Sampling())) for p in prompts] == expected
        channels = [engine.submit_generate(p, 12, Sampling()) for p in prompts]
        assert [list(channel) for channel in channels] == expected
        info = engine.open(prompts[0])
        result = engine.verify(info.session_id, [*expected[0][:3], 0])
        assert (result.accepted, result.next_token) == (3, expected[0][3])
    finally:
        engine.stop()
