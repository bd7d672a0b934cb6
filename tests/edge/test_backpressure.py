"""Backpressure over real gRPC: full queues answer RESOURCE_EXHAUSTED with a retry-after at once,
the ingress holds a bounded number of calls, and only a session really lost is NOT_FOUND."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.fleet.wire import CallResult
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.limits import retry_after_ms
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from tests.edge.harness import running_ingress

PASS_S = 0.3  # each forward pass of the slowed target


@pytest.fixture(scope="module")
def slow_verifier(
    make_tiny_llama: Callable[..., torch.nn.Module], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[pb_grpc.VerifierStub, threading.Event]]:
    """A verifier of queue 2, one verify per pass; its passes take PASS_S once `slow` is set."""
    model = make_tiny_llama(32, 1, 16, seed=1)
    slow = threading.Event()
    model.register_forward_hook(lambda *_: time.sleep(PASS_S) if slow.is_set() else None)
    config = ServerConfig(
        tmp_path_factory.mktemp("slow"),
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=4, max_queue=2, max_batch=1, batch_window_s=0.0),
    )
    with BackgroundServer(config, model) as server:  # type: ignore[arg-type]
        yield pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{server.port}")), slow


def test_a_full_verify_queue_answers_at_once_with_a_retry_after(
    slow_verifier: tuple[pb_grpc.VerifierStub, threading.Event],
) -> None:
    """Eight verifies reach a verifier that holds one in its pass and two in its queue: the rest
    are refused RESOURCE_EXHAUSTED at once, each with fedge-retry-after-ms.

    On main a full queue answered RESOURCE_EXHAUSTED without a retry-after, so the edge could
    only guess its backoff (checked on main)."""
    stub, slow = slow_verifier
    for index in range(8):
        stub.Verify(pb.VerifyRequest(session_id=f"q{index}", committed_ids=[2, 3]))
    slow.set()
    try:
        calls = [
            stub.Verify.future(pb.VerifyRequest(session_id=f"q{i}", draft_ids=[4]), timeout=30)
            for i in range(8)
        ]
        refused = []
        for call in calls:
            try:
                call.result()
            except grpc.RpcError as error:
                refused.append(error)
    finally:
        slow.clear()
    assert 1 <= len(refused) <= 5
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert retry_after_ms(error.trailing_metadata()) == 50  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fault", "code", "retry_after"),
    [
        (
            lambda: BackPressureError(num_queued_requests=9, max_queued_requests=8),
            "RESOURCE_EXHAUSTED",
            True,
        ),
        (lambda: ActorDiedError(), "NOT_FOUND", False),
        (lambda: ValueError("a bug in the relay"), "UNAVAILABLE", False),
    ],
)
def test_the_ingress_maps_each_relay_failure_to_what_the_edge_should_do(
    fault: Callable[[], BaseException], code: str, retry_after: bool
) -> None:
    """A session's call whose relay fails: full queues are RESOURCE_EXHAUSTED with a retry-after,
    a dead replica NOT_FOUND (the session is gone: reopen), anything else UNAVAILABLE (retry the
    same idempotent call; the session may well be there).

    On main every relay failure of a session's call became NOT_FOUND, and the edge re-prefilled
    its whole context on overload or a bug (checked on main)."""
    with running_ingress(IngressSpec("fedge-v1")) as (front, replicas):
        replicas.fail = fault
        front.call(front.state.remember("Verify", "s1", "fedge-v1", CallResult("OK", replica="r1")))
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{front.port()}"))
        with pytest.raises(grpc.RpcError) as failed:
            stub.Verify(pb.VerifyRequest(session_id="s1", draft_ids=[4]), timeout=10)
    error = failed.value
    assert error.code() == grpc.StatusCode[code]  # type: ignore[attr-defined]
    assert (retry_after_ms(error.trailing_metadata()) is not None) == retry_after  # type: ignore[attr-defined]


def test_the_ingress_holds_a_bounded_number_of_calls_and_refuses_the_next_at_once() -> None:
    """Two calls wait on replicas that do not answer; the third is refused RESOURCE_EXHAUSTED
    with a retry-after at once, so overload cannot pile calls up in the ingress's memory.

    On main the ingress held every call it was sent (Serve's queue was unbounded) until its
    deadline expired (checked on main: the third call waited too)."""
    with running_ingress(IngressSpec("fedge-v1", max_inflight=2)) as (front, replicas):
        replicas.gate = threading.Event()
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{front.port()}"))
        opening = pb.VerifyRequest(session_id="w", committed_ids=[2, 3])
        waiting = [stub.Verify.future(opening, timeout=30) for _ in range(2)]
        deadline = time.monotonic() + 10
        while front.admission.held < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stub.Verify(opening, timeout=10)
        assert time.monotonic() - started < 5  # at once, not after the others
        replicas.gate.set()
        for call in waiting:
            with pytest.raises(grpc.RpcError):
                call.result()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert retry_after_ms(refused.value.trailing_metadata()) is not None  # type: ignore[attr-defined]
    assert front.admission.refused == 1 and front.admission.held == 0
