"""Versioned sessions over real gRPC: the verifier names its weights, adapter and tokenizer; a
reopen returns to its version or is told it is gone; the edge refuses another tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, TokenizerMismatch, VerifierClient
from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.fleet.wire import CallResult
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.errors import VERSION_GONE_KEY
from fedge.edge.verifier.identity import serving_identity, tokenizer_dir_id
from fedge.edge.verifier.server import BackgroundServer, ServerConfig, load_verifier_model
from fedge.zoo import ZooPaths
from tests.edge.harness import running_ingress
from tests.edge.test_service import greedy


def swapped_tokenizer(source: Path, out: Path) -> Path:
    """The source's tokenizer with two ids swapped: the same size, another vocabulary."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.__getitem__)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def test_the_edge_refuses_a_verifier_whose_tokenizer_differs_from_its_drafts(
    verifier_port: int, micro_zoo: ZooPaths, tmp_path: Path
) -> None:
    """A draft whose vocabulary has the verifier's size but two ids swapped is refused at open.

    On main nothing compared the tokenizers: such a draft opened sessions and decoded text
    that read plausibly and was wrong."""
    target = f"127.0.0.1:{verifier_port}"
    drafts = tokenizer_dir_id(micro_zoo.draft_dir)
    other = tokenizer_dir_id(swapped_tokenizer(micro_zoo.draft_dir, tmp_path / "swapped"))
    assert other and other != drafts
    with VerifierClient(ClientConfig(target, tokenizer_id=drafts)) as client:
        info = client.open([1, 2, 3])
        assert info.tokenizer_id == drafts and info.model_id
        client.close(info.session_id)
    with (
        VerifierClient(ClientConfig(target, tokenizer_id=other)) as client,
        pytest.raises(TokenizerMismatch, match=other),
    ):
        client.open([1, 2, 3])


def test_a_session_whose_version_is_gone_is_told_so_and_restarts_on_the_new_one(
    micro_zoo: ZooPaths,
    micro_target: PreTrainedModel,
    lora_adapter: Path,
    micro_prompts: list[list[int]],
) -> None:
    """The verifier is replaced by one serving an adapter, on the same address, mid-session. The
    edge's reopen names the session's version, is refused FAILED_PRECONDITION (fedge-version-gone),
    and the session restarts from its committed tokens on the new weights, exactly.

    On main the reopen carried no version: the session silently continued on other weights, its
    text a mix of two models, and nothing told the edge (checked on main: the reopen succeeded)."""
    engine = EngineConfig(max_draft=8)
    base = ServerConfig(micro_zoo.target_dir, drain_notice_s=0.0, engine=engine)
    prompt = micro_prompts[7]
    old = greedy(micro_target, prompt, 4)
    with BackgroundServer(base, micro_target) as first:
        port = first.port
        client = VerifierClient(ClientConfig(f"127.0.0.1:{port}", timeout_s=5))
        info = client.open(prompt)
        assert client.verify(info.session_id, old[:3]).next_token == old[3]
    upgraded = ServerConfig(
        micro_zoo.target_dir, lora_adapter, port=port, drain_notice_s=0.0, engine=engine
    )
    adapted = load_verifier_model(micro_zoo.target_dir, lora_adapter)
    committed = [*prompt, *old]
    new = greedy(adapted, committed, 3)
    with BackgroundServer(upgraded, adapted) as second:
        assert second.port == port
        raw = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        reopen = pb.VerifyRequest(session_id="x", committed_ids=prompt, version=info.version)
        with pytest.raises(grpc.RpcError) as gone:
            raw.Verify(reopen)
        assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        served = dict(gone.value.trailing_metadata())[VERSION_GONE_KEY]  # type: ignore[attr-defined]
        assert served == serving_identity(micro_zoo.target_dir, lora_adapter).version
        assert served != info.version
        result = client.verify(info.session_id, new[:2])
        assert (result.accepted, result.next_token) == (2, new[2])
        assert client.version_changes == 1 and client.reopens == 2  # refused, then on the new one
        client.close_channel()


def test_the_ingress_returns_a_reopen_to_its_version_not_to_the_canary(
    ingress_state_options: dict[str, Any],
) -> None:
    """A session opened on the stable version reopens (its replica lost) on that version, though
    every new session goes to the canary; a version no application serves goes to the stable one.

    On main a reopen took part in the canary split again: with the canary at 100% it moved the
    session onto the canary's weights mid-decode (checked on main)."""
    with running_ingress(IngressSpec("fedge-v1", **ingress_state_options)) as (front, _):
        opened = pb.VerifyReply(opened=pb.SessionInfo(model_id="m1", adapter_id="a1"))
        front.call(front.state.learn_version(opened, "fedge-v1"))
        front.call(
            front.state.learn_version(
                pb.OpenSessionReply(model_id="m1", adapter_id="a2"), "fedge-v2"
            )
        )
        front.call(
            front.state.remember(
                "Verify", "s1", "fedge-v1", CallResult("OK", replica="r1"), "alice"
            )
        )
        front.call(front.set_canary("fedge-v2", 1.0))
        assert front.call(front.state.target("new", "alice")) == ("fedge-v2", "")
        assert front.call(front.state.target("s2", "alice", "m1/a1")) == ("fedge-v1", "")
        assert front.call(front.state.target("s2", "alice", "m1/a2")) == ("fedge-v2", "")
        assert front.call(front.state.target("s2", "alice", "m0/")) == ("fedge-v1", "")
