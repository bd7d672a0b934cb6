"""Sessions belong to their owner, over real gRPC: two devices with valid credentials, one an
attacker. It cannot read, advance, close or evict the other's sessions, nor prefill for free."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import PreTrainedModel

from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.fleet.wire import CallResult
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.limits import RateLimitConfig, retry_after_ms
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths
from tests.edge.harness import running_ingress, write_credentials
from tests.edge.test_service import greedy

Auth = tuple[tuple[str, str], ...]
PREFILL_BURST = 16


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Auth]]:
    """Credentials of alice (the victim), mallory (the attacker) and carol; each one's metadata."""
    path, tokens = write_credentials(
        tmp_path_factory.mktemp("creds"), ["alice", "mallory", "carol"]
    )
    return path, {d: (("authorization", f"Bearer {t}"),) for d, t in tokens.items()}


@pytest.fixture(scope="module")
def stub(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, devices: tuple[Path, dict[str, Auth]]
) -> Iterator[pb_grpc.VerifierStub]:
    """A verifier of 4 sessions, 3 per device, prefill 1 token/s per device (burst 16)."""
    config = ServerConfig(
        micro_zoo.target_dir,
        credentials_file=devices[0],
        drain_notice_s=0.0,
        rate_limits=RateLimitConfig(prefill_rate=1.0, prefill_burst=PREFILL_BURST),
        engine=EngineConfig(max_draft=8, max_sessions=4, max_sessions_per_token=3),
    )
    with BackgroundServer(config, micro_target) as server:
        yield pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        assert server.server is not None and server.server.engine is not None
        for session in list(server.server.engine.sessions._sessions.values()):
            server.server.engine.close(session.session_id, session.owner)


def code(call: object) -> grpc.StatusCode:
    """The status a zero-argument call fails with."""
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    return caught.value.code()  # type: ignore[attr-defined,no-any-return]


def test_another_device_can_neither_read_advance_nor_close_a_session(
    stub: pb_grpc.VerifierStub,
    devices: tuple[Path, dict[str, Auth]],
    micro_target: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    """Mallory knows alice's session id. Reading it (a verify, whose reply names the target's
    next token on alice's private context), advancing it or closing it is NOT_FOUND for her;
    her reopen under that id makes a session of her own; alice's continues untouched.

    On main sessions were scoped only by bearer token and `fedge verifier fleet` took one
    token for every device, so any device holding it read, advanced and closed the others'."""
    alice, mallory = devices[1]["alice"], devices[1]["mallory"]
    prompt = micro_prompts[4]  # 8 tokens: alice's prefill stays within her bucket in this file
    expected = greedy(micro_target, prompt, 6)
    opened = stub.Verify(
        pb.VerifyRequest(session_id="alice-1", committed_ids=prompt, draft_ids=expected[:2]),
        metadata=alice,
    )
    length = opened.session_length
    peek = pb.VerifyRequest(session_id="alice-1", draft_ids=[])
    advance = pb.VerifyRequest(session_id="alice-1", draft_ids=[5], expected_length=length)
    close = pb.CloseSessionRequest(session_id="alice-1")
    assert code(lambda: stub.Verify(peek, metadata=mallory)) == grpc.StatusCode.NOT_FOUND
    assert code(lambda: stub.Verify(advance, metadata=mallory)) == grpc.StatusCode.NOT_FOUND
    assert code(lambda: stub.CloseSession(close, metadata=mallory)) == grpc.StatusCode.NOT_FOUND
    own = pb.VerifyRequest(session_id="alice-1", committed_ids=[7, 8], draft_ids=[])
    assert stub.Verify(own, metadata=mallory).session_length == 3  # her own, not alice's
    follow = pb.VerifyRequest(session_id="alice-1", draft_ids=expected[3:5], expected_length=length)
    reply = stub.Verify(follow, metadata=alice)
    assert (reply.accepted, reply.next_token) == (2, expected[5])
    stub.CloseSession(close, metadata=mallory)
    assert stub.CloseSession(close, metadata=alice).session_length == length + 3


def test_one_device_cannot_evict_another_devices_sessions(
    stub: pb_grpc.VerifierStub, devices: tuple[Path, dict[str, Auth]]
) -> None:
    """The verifier holds 4 sessions, 3 per device. Alice holds 2; mallory opens 4. Mallory makes
    room only among her own sessions: alice's two verify without a reopen.

    On main a full store evicted the least recently used idle session of any device: mallory's
    third open evicted alice's oldest session, whose next verify was NOT_FOUND (checked on main)."""
    alice, mallory = devices[1]["alice"], devices[1]["mallory"]
    for name in ("a1", "a2"):
        stub.Verify(pb.VerifyRequest(session_id=name, committed_ids=[3, 4]), metadata=alice)
    for index in range(4):
        request = pb.VerifyRequest(session_id=f"m{index}", committed_ids=[5, 6])
        stub.Verify(request, metadata=mallory)
    for name in ("a1", "a2"):
        assert stub.Verify(pb.VerifyRequest(session_id=name), metadata=alice).session_length == 4
        stub.CloseSession(pb.CloseSessionRequest(session_id=name), metadata=alice)
    assert code(lambda: stub.Verify(pb.VerifyRequest(session_id="m0"), metadata=mallory)) == (
        grpc.StatusCode.NOT_FOUND  # her own oldest gave way
    )


def test_opens_and_reopens_pay_for_the_tokens_they_prefill(
    stub: pb_grpc.VerifierStub, devices: tuple[Path, dict[str, Auth]]
) -> None:
    """Carol reopens a session with 40 committed tokens and an empty draft: 40 prefill tokens,
    not 1. Her bucket (16) is in debt, so her next open waits ~26 s; alice's opens do not.

    On main a Verify cost `len(draft_ids) + 1` whatever it prefilled and OpenSession was free:
    the same 40-token reopen cost 1 token and the next open passed at once (checked on main)."""
    carol, alice = devices[1]["carol"], devices[1]["alice"]
    flood = pb.VerifyRequest(session_id="c1", committed_ids=list(range(3, 43)), draft_ids=[])
    assert stub.Verify(flood, metadata=carol).session_length == 41
    again = pb.OpenSessionRequest(prompt_ids=[3, 4])
    with pytest.raises(grpc.RpcError) as refused:
        stub.OpenSession(again, metadata=carol)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    wait_ms = retry_after_ms(refused.value.trailing_metadata())  # type: ignore[attr-defined]
    assert wait_ms is not None and 20_000 < wait_ms <= 27_000  # (2 + 24 of debt) tokens at 1/s
    opened = stub.OpenSession(again, metadata=alice)
    stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), metadata=alice)
    stub.CloseSession(pb.CloseSessionRequest(session_id="c1"), metadata=carol)


def test_the_ingress_finds_a_session_only_for_its_owner(
    ingress_state_options: dict[str, Any],
) -> None:
    """The fleet ingress maps a session to its replica per owner: mallory naming alice's session
    is routed as a new session, and her NOT_FOUND there leaves alice's affinity in place.

    On main the map was keyed by session id alone: mallory's call went to alice's replica and
    its NOT_FOUND dropped alice's entry, so alice's next verify landed anywhere and re-prefilled
    (checked on main)."""
    with running_ingress(IngressSpec("fedge-v1", **ingress_state_options)) as (front, _):
        front.call(
            front.state.remember(
                "Verify", "s1", "fedge-v1", CallResult("OK", replica="r1"), "alice"
            )
        )
        assert front.call(front.state.target("s1", "mallory")) == ("fedge-v1", "")
        front.call(
            front.state.remember("Verify", "s1", "fedge-v1", CallResult("NOT_FOUND"), "mallory")
        )
        front.call(
            front.state.remember(
                "CloseSession", "s1", "fedge-v1", CallResult("OK", replica="r2"), "mallory"
            )
        )
        assert front.call(front.state.target("s1", "alice")) == ("fedge-v1", "r1")


def test_the_ingress_forgets_a_session_whose_home_can_no_longer_serve_it(
    ingress_state_options: dict[str, Any],
) -> None:
    """A session whose replica lost it (NOT_FOUND), or whose close failed there (UNAVAILABLE), leaves
    the map; a full queue (RESOURCE_EXHAUSTED) keeps it on its replica.

    Before, only NOT_FOUND and a successful close removed an entry: once relay failures were
    told apart, a session on a killed replica stayed mapped to it (the fleet's replica-kill test
    failed once in CI on that leftover entry)."""
    with running_ingress(IngressSpec("fedge-v1", **ingress_state_options)) as (front, _):
        for sid in ("dead", "closing", "busy"):
            front.call(
                front.state.remember(
                    "Verify", sid, "fedge-v1", CallResult("OK", replica="r1"), "alice"
                )
            )
        front.call(
            front.state.remember("Verify", "dead", "fedge-v1", CallResult("NOT_FOUND"), "alice")
        )
        front.call(
            front.state.remember(
                "CloseSession", "closing", "fedge-v1", CallResult("UNAVAILABLE"), "alice"
            )
        )
        front.call(
            front.state.remember(
                "Verify", "busy", "fedge-v1", CallResult("RESOURCE_EXHAUSTED"), "alice"
            )
        )
        assert front.call(front.fleet_stats())["sessions"] == {"r1": 1}
        assert front.call(front.state.target("busy", "alice")) == ("fedge-v1", "r1")
        assert front.call(front.state.target("dead", "alice")) == ("fedge-v1", "")
