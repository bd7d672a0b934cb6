"""The recovery protocol over real gRPC: idempotent retries, open folded into verify, reopen, quotas, limits."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths
from tests.edge.test_service import code_of, greedy

TOKENS = ("alpha-token", "beta-token")


@pytest.fixture(scope="module")
def server(micro_zoo: ZooPaths, micro_target: PreTrainedModel) -> Iterator[BackgroundServer]:
    """A verifier with two client tokens, a per-token quota of 4 and a 64 KiB message limit."""
    config = ServerConfig(
        micro_zoo.target_dir,
        tokens=TOKENS,
        drain_notice_s=0.0,
        max_message_bytes=64 << 10,
        engine=EngineConfig(max_draft=8, max_sessions=8, max_sessions_per_token=4),
    )
    with BackgroundServer(config, micro_target) as background:
        yield background


def stub_for(server: BackgroundServer, token: str) -> tuple[pb_grpc.VerifierStub, object]:
    """A raw stub plus the call metadata carrying `token`."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return pb_grpc.VerifierStub(channel), (("authorization", f"Bearer {token}"),)


def test_verify_opens_retries_are_idempotent_and_divergence_aborts(
    server: BackgroundServer, micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    # Prepare: the target's own tokens as the draft, so acceptance is known by hand
    stub, auth = stub_for(server, TOKENS[0])
    prompt = micro_prompts[6]
    expected = greedy(micro_target, prompt, 10)
    first = pb.VerifyRequest(
        session_id="edge-chosen-1",
        draft_ids=expected[:3],
        expected_length=len(prompt),
        committed_ids=prompt,
    )
    # Execute: open folded into the first verify, then the same verify again (a retry)
    reply = stub.Verify(first, metadata=auth)
    retry = stub.Verify(first, metadata=auth)
    # Assert: one application only; the retry gets the stored reply
    assert reply.HasField("opened") and reply.opened.max_draft == 8
    assert (reply.accepted, reply.next_token) == (3, expected[3])
    assert reply.session_length == len(prompt) + 4
    assert (retry.accepted, retry.next_token, retry.session_length) == (
        3,
        expected[3],
        len(prompt) + 4,
    )
    assert not retry.HasField("opened")
    follow = pb.VerifyRequest(
        session_id="edge-chosen-1", draft_ids=expected[4:6], expected_length=len(prompt) + 4
    )
    assert stub.Verify(follow, metadata=auth).next_token == expected[6]
    stale = pb.VerifyRequest(
        session_id="edge-chosen-1", draft_ids=[1], expected_length=len(prompt) + 1
    )
    assert code_of(lambda: stub.Verify(stale, metadata=auth)) == grpc.StatusCode.ABORTED
    other = stub_for(server, TOKENS[1])
    assert code_of(lambda: other[0].Verify(follow, metadata=other[1])) == grpc.StatusCode.NOT_FOUND
    stub.CloseSession(pb.CloseSessionRequest(session_id="edge-chosen-1"), metadata=auth)


def test_lost_session_is_reopened_from_committed_tokens(
    server: BackgroundServer,
    micro_target: PreTrainedModel,
    micro_draft: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    """Sessions dropped mid-decode (as eviction or a restart does) continue exactly."""
    assert server.server is not None and server.server.engine is not None
    engine = server.server.engine
    config = ClientConfig(f"127.0.0.1:{server.port}", token=TOKENS[1])
    with VerifierClient(config) as client:
        outputs = []
        for prompt in micro_prompts[10:13]:
            decoder = SpeculativeDecoder(
                TorchDraftRuntime(micro_draft), client, DecodeConfig(max_new_tokens=20)
            )
            produced = []
            for chunk in decoder.stream(prompt):
                produced += chunk
                if len(produced) < 12:  # drop every session the verifier holds, twice or more
                    for session in list(engine.sessions._sessions.values()):
                        engine.close(session.session_id, session.owner)
            outputs.append(produced)
        assert client.reopens >= 3
    assert outputs == [greedy(micro_target, p, 20) for p in micro_prompts[10:13]]


def test_bad_probabilities_name_the_field(server: BackgroundServer) -> None:
    stub, auth = stub_for(server, TOKENS[0])
    base = {
        "session_id": "sampled-1",
        "committed_ids": [3, 4, 5],
        "sampling": pb.Sampling(temperature=0.8, seed=1),
    }
    cases = {
        "draft_probs": ([math.nan], [pb.DraftDistribution(token_ids=[7], probs=[1.0])]),
        "draft_dists[0].probs": ([1.0], [pb.DraftDistribution(token_ids=[7], probs=[math.nan])]),
        "draft_dists[0].probs ": (
            [1.0],
            [pb.DraftDistribution(token_ids=[7, 8], probs=[1.5, -0.5])],
        ),
    }
    for field, (probs, dists) in cases.items():
        request = pb.VerifyRequest(draft_ids=[7], draft_probs=probs, draft_dists=dists, **base)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Verify(request, metadata=auth)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert caught.value.details().startswith(field.strip())  # type: ignore[attr-defined]


def test_one_token_cannot_evict_another_tokens_sessions(server: BackgroundServer) -> None:
    alpha, alpha_auth = stub_for(server, TOKENS[0])
    beta, beta_auth = stub_for(server, TOKENS[1])
    beta_ids = [
        beta.OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 2]), metadata=beta_auth).session_id
        for _ in range(3)
    ]
    alpha_ids = [
        alpha.OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 2]), metadata=alpha_auth).session_id
        for _ in range(7)
    ]
    live = lambda stub, auth, sid: stub.Verify(  # noqa: E731
        pb.VerifyRequest(session_id=sid, draft_ids=[]), metadata=auth
    )
    for sid in beta_ids:  # all of beta's survive alpha's flood
        live(beta, beta_auth, sid)
    for sid in alpha_ids[-4:]:  # alpha keeps its newest 4 (its quota) ...
        live(alpha, alpha_auth, sid)
    for sid in alpha_ids[:3]:  # ... and lost its own oldest
        assert code_of(lambda sid=sid: live(alpha, alpha_auth, sid)) == grpc.StatusCode.NOT_FOUND
    for sid in alpha_ids[-4:]:
        alpha.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=alpha_auth)
    for sid in beta_ids:
        beta.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=beta_auth)


def test_request_limits(server: BackgroundServer) -> None:
    stub, auth = stub_for(server, TOKENS[0])
    huge = pb.OpenSessionRequest(prompt_ids=[1000] * 40_000)  # 80 kB > 64 KiB on the wire
    assert code_of(lambda: stub.OpenSession(huge, metadata=auth)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    bad_id = pb.VerifyRequest(session_id="x" * 65, committed_ids=[1, 2])
    with pytest.raises(grpc.RpcError) as caught:
        stub.Verify(bad_id, metadata=auth)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "session_id" in caught.value.details()  # type: ignore[attr-defined]
    near_miss, near_auth = stub_for(server, "alpha-tokem")
    small = pb.OpenSessionRequest(prompt_ids=[1, 2])
    assert code_of(lambda: near_miss.OpenSession(small, metadata=near_auth)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
