"""Ring attention in the verifier: exact sharded prefill, exact sharded verifies, a worker killed mid-prefill.

One verifier on 127.0.0.1 serves the micro target with a ring of two worker processes
(prompts above 64 tokens are sharded); the tests talk to it over real gRPC.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from transformers import PreTrainedModel

from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.verifier.engine import EngineConfig, VerifierEngine
from fedge.edge.verifier.ring import RingPool, ShardedKV
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths

THRESHOLD = 64


@pytest.fixture(scope="module")
def ring_server(micro_zoo: ZooPaths, micro_target: PreTrainedModel) -> Iterator[BackgroundServer]:
    """A verifier whose prompts above THRESHOLD tokens prefill on a ring of 2 processes."""
    engine = EngineConfig(
        max_draft=8, ring_size=2, ring_threshold=THRESHOLD, ring_block=32, batch_window_s=0.0
    )
    server = BackgroundServer(
        ServerConfig(micro_zoo.target_dir, drain_notice_s=0.0, engine=engine), micro_target
    )
    server.start()
    yield server
    server.stop(grace_s=0.2)


def _engine(server: BackgroundServer) -> VerifierEngine:
    assert server.server is not None and server.server.engine is not None
    return server.server.engine


def _pool(server: BackgroundServer) -> RingPool:
    pool: RingPool = _engine(server).runtime.pool  # type: ignore[attr-defined]
    return pool


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(model: PreTrainedModel, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _speculate(
    stub: pb_grpc.VerifierStub, draft: PreTrainedModel, sid: str, prompt: list[int], new: int
) -> list[int]:
    """Greedy draft-and-verify to `new` tokens; every third round spoils the draft's last token."""
    committed, rounds = list(prompt), 0
    while len(committed) - len(prompt) < new:
        proposal = _greedy(draft, committed, 4)
        if rounds % 3 == 2:
            proposal[-1] = (proposal[-1] + 1) % 1000  # forces a rejection: a crop on the ring
        reply = stub.Verify(pb.VerifyRequest(session_id=sid, draft_ids=proposal))
        committed += [*proposal[: reply.accepted], reply.next_token]
        assert reply.session_length == len(committed)
        rounds += 1
    return committed[len(prompt) : len(prompt) + new]


def test_ring_prefill_logits_equal_single_process(
    ring_server: BackgroundServer, micro_target: PreTrainedModel
) -> None:
    """256 tokens through a ring of 2 give the one-process logits within 1e-4 (fp32)."""
    tokens = _prompt(256, 0)
    with torch.no_grad():
        expected = micro_target(input_ids=torch.tensor([tokens])).logits
    pool = _pool(ring_server)
    kv, logits = pool.prefill(tokens, want_logits=True)  # the pool serialises callers
    try:
        stats = list(pool.last_stats)
        step = pool.step(kv, [7, 8])
    finally:
        pool.release(kv)
    with torch.no_grad():
        after = micro_target(input_ids=torch.tensor([[*tokens, 7, 8]])).logits[:, -2:]
    assert (logits - expected).abs().max().item() < 1e-4
    assert (step - after).abs().max().item() < 1e-4
    # each rank holds its own half of the KV, never the whole sequence's
    full = 256 * _engine(ring_server).bytes_per_position
    assert [s["kv_bytes"] for s in stats] == [full // 2, full // 2]


def test_sharded_session_greedy_speculative_output_identical(
    ring_server: BackgroundServer, micro_target: PreTrainedModel, micro_draft: PreTrainedModel
) -> None:
    """A 150-token prompt is sharded; speculative decoding on it gives plain greedy's tokens."""
    prompt = _prompt(150, 1)
    expected = _greedy(micro_target, prompt, 24)
    with grpc.insecure_channel(f"127.0.0.1:{ring_server.port}") as channel:
        stub = pb_grpc.VerifierStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt)).session_id
        session = _engine(ring_server).sessions.get(sid)
        assert isinstance(session.cache, ShardedKV) and session.length == 150
        assert _speculate(stub, micro_draft, sid, prompt, 24) == expected
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert session.cache.released


def _wait(condition: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_ring_worker_killed_mid_prefill_fails_cleanly_and_sessions_reopen_exactly(
    ring_server: BackgroundServer, micro_target: PreTrainedModel
) -> None:
    """Kill ring worker 1 (by pid) while a prefill waits on it.

    Before the ring had a failure path a dead rank left the others blocked in the ring
    exchange and the caller waiting; here the open fails UNAVAILABLE naming the worker, the
    other rank is ended, a sharded session opened earlier answers NOT_FOUND and reopens from
    its committed tokens on a fresh ring, giving the same tokens as one process. The death is
    named with its pid whether the rank's exit or its closed pipe is seen first (a fresh-clone
    run saw the pipe first and the message named no pid).
    """
    pool = _pool(ring_server)
    older = _prompt(100, 2)
    expected = _greedy(micro_target, older, 4)
    with grpc.insecure_channel(f"127.0.0.1:{ring_server.port}") as channel:
        stub = pb_grpc.VerifierStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=older)).session_id
        first = stub.Verify(pb.VerifyRequest(session_id=sid, draft_ids=[expected[0]]))
        assert (first.accepted, first.next_token) == (1, expected[1])
        pids = pool.pids
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 cannot finish: the prefill is surely mid-way
        try:
            call = stub.OpenSession.future(pb.OpenSessionRequest(prompt_ids=_prompt(200, 3)))
            _wait(lambda: pool.in_flight == "prefill")
        finally:
            os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as caught:
            call.result(timeout=120)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        details = caught.value.details()  # type: ignore[attr-defined]
        assert f"ring worker 1 (pid {pids[1]}) died during prefill" in details, details
        assert "reopen" in details
        _wait(lambda: not _alive(pids[0]), 30.0)  # rank 0 was ended too, not left blocked
        # the older sharded session is gone: NOT_FOUND, then a reopen from committed tokens
        with pytest.raises(grpc.RpcError) as gone:
            stub.Verify(pb.VerifyRequest(session_id=sid, draft_ids=[expected[2]]))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        committed = [*older, expected[0], expected[1]]
        reply = stub.Verify(
            pb.VerifyRequest(session_id=sid, draft_ids=[expected[2]], committed_ids=committed)
        )
        assert reply.HasField("opened")  # reopened, on a new ring
        assert isinstance(_engine(ring_server).sessions.get(sid).cache, ShardedKV)
        assert (reply.accepted, reply.next_token) == (1, expected[3])
        assert set(pool.pids).isdisjoint(pids)
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False
