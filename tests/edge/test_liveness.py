"""The verifier survives its clients: cancelled, expired and dropped calls never wedge it."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import EXIT_ENGINE_DIED, BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths
from tests.edge.test_service import given_up_on, greedy, health_status

WELL_BEHAVED = 8
ADVERSARIES = 50
NEW_TOKENS = 24
PATIENCE_S = 10.0  # deadline of calls that should not be slow: a wedged verifier fails, not hangs


def poll(condition: Callable[[], bool], within_s: float, what: str) -> None:
    """Wait until `condition()` holds, failing with `what` after `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture()
def server(micro_zoo: ZooPaths, micro_target: PreTrainedModel) -> Iterator[BackgroundServer]:
    """A private verifier (its own engine, so a storm or a kill touches no other test)."""
    config = ServerConfig(
        micro_zoo.target_dir,
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=8, batch_window_s=0.002),
    )
    with BackgroundServer(config, micro_target) as background:
        yield background


async def misbehave(port: int, prompts: list[list[int]], seed: int) -> None:
    """50 calls that go away at random points: cancel, tiny deadline, dropped connection."""
    rng = random.Random(seed)

    async def one(i: int) -> None:
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        kind = i % 5
        prompt = prompts[i % len(prompts)]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.VerifierStub(channel)
        try:
            if kind == 0:  # Ctrl-C in `fedge edge generate`: cancel after a few tokens
                request = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=20)
                call = stub.Generate(request, timeout=PATIENCE_S)
                for _ in range(rng.randrange(0, 6)):
                    await call.read()
                call.cancel()
            elif kind == 1:  # a stream whose deadline expires mid-generation
                request = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=40)
                async for _ in stub.Generate(request, timeout=rng.uniform(0.001, 0.05)):
                    pass
            elif kind == 2:  # an opening verify whose deadline expires; the edge then closes
                sid = f"adversary-{i}"
                opening = pb.VerifyRequest(session_id=sid, draft_ids=[5], committed_ids=prompt)
                with contextlib.suppress(grpc.RpcError):
                    await stub.Verify(opening, timeout=rng.uniform(0.0005, 0.01))
                closing = pb.CloseSessionRequest(session_id=sid)
                await stub.CloseSession(closing, timeout=PATIENCE_S)
            elif kind == 3:  # a verify cancelled in flight; the client then closes its session
                opening = pb.OpenSessionRequest(prompt_ids=prompt)
                sid = (await stub.OpenSession(opening, timeout=PATIENCE_S)).session_id
                verify = pb.VerifyRequest(session_id=sid, draft_ids=[5, 6, 7])
                call = stub.Verify(verify, timeout=PATIENCE_S)
                await asyncio.sleep(rng.uniform(0.0, 0.005))
                call.cancel()
                closing = pb.CloseSessionRequest(session_id=sid)
                await stub.CloseSession(closing, timeout=PATIENCE_S)
            else:  # the connection drops mid-stream
                request = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=30)
                call = stub.Generate(request, timeout=PATIENCE_S)
                await call.read()
                await channel.close(grace=None)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            await channel.close(grace=None)

    await asyncio.gather(*(one(i) for i in range(ADVERSARIES)))


def test_cancelled_calls_never_wedge_the_verifier(
    server: BackgroundServer,
    micro_target: PreTrainedModel,
    micro_draft: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    """8 decoding sessions finish exact while 50 others cancel, expire or drop at random points."""
    # Prepare
    prompts = micro_prompts[:WELL_BEHAVED]
    expected = [greedy(micro_target, p, NEW_TOKENS) for p in prompts]
    outputs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def decode(i: int) -> None:
        try:
            target = f"127.0.0.1:{server.port}"
            with VerifierClient(ClientConfig(target, timeout_s=PATIENCE_S)) as link:
                config = DecodeConfig(max_new_tokens=NEW_TOKENS, draft_len=1 + i % 3)
                decoder = SpeculativeDecoder(TorchDraftRuntime(micro_draft), link, config)
                outputs[i] = decoder.generate(prompts[i])
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    # Execute
    workers = [threading.Thread(target=decode, args=(i,)) for i in range(WELL_BEHAVED)]
    for worker in workers:
        worker.start()
    asyncio.run(misbehave(server.port, micro_prompts, seed=12))
    for worker in workers:
        worker.join(3 * PATIENCE_S)

    # Assert: every well-behaved session exact, and the verifier still healthy and leak-free
    assert not errors, errors
    assert [outputs[i] for i in range(WELL_BEHAVED)] == expected
    assert server.server is not None and server.server.engine is not None
    engine = server.server.engine
    assert engine.running and engine.death is None
    assert health_status(server.port) == health_pb2.HealthCheckResponse.SERVING
    poll(lambda: len(engine.sessions) == 0, 10, "abandoned sessions to be closed")
    registry = server.server.metrics.registry
    cancelled = registry.get_sample_value(
        "fedge_verifier_requests_total", {"method": "Generate", "code": "CANCELLED"}
    )
    assert cancelled is not None and cancelled >= 1  # cancelled calls are counted
    assert registry.get_sample_value("fedge_verifier_worker_alive") == 1.0
    with VerifierClient(ClientConfig(f"127.0.0.1:{server.port}", timeout_s=10)) as client:
        assert list(client.generate(prompts[0], NEW_TOKENS)) == expected[0]


def kill_thread(thread: threading.Thread) -> None:
    """Raise SystemExit inside `thread` (CPython's async exception): a worker dying for real."""
    assert thread.ident is not None
    hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)
    )
    assert hit == 1


def test_dead_worker_means_not_serving_and_a_failing_exit(server: BackgroundServer) -> None:
    """A killed engine worker: health NOT_SERVING, calls UNAVAILABLE, serve's exit status non-zero."""
    # Prepare
    assert server.server is not None and server.server.engine is not None
    engine = server.server.engine
    worker = engine._thread  # this server's worker (other tests' engines may be alive too)
    assert worker is not None

    async def wait_for_exit() -> int:
        assert server.server is not None
        return await server.server.wait(asyncio.Event())

    # Execute
    kill_thread(worker)
    # Assert
    poll(lambda: not worker.is_alive(), 10, "the worker to die")
    assert isinstance(engine.death, SystemExit)
    poll(
        lambda: health_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING,
        10,
        "health to report NOT_SERVING",
    )
    target = f"127.0.0.1:{server.port}"
    with VerifierClient(ClientConfig(target, timeout_s=5, unreachable_after_s=0)) as client:
        assert given_up_on(lambda: client.open([1, 2, 3])) == grpc.StatusCode.UNAVAILABLE
    assert server.submit(wait_for_exit()).result(10) == EXIT_ENGINE_DIED  # what serve() exits with


def test_generate_cancelled_in_the_tight_loop_stops_at_once(
    server: BackgroundServer, micro_prompts: list[list[int]]
) -> None:
    """Ctrl-C after two tokens of a long lone stream: decoding stops and the session is freed."""
    # Prepare
    assert server.server is not None and server.server.engine is not None
    engine, registry = server.server.engine, server.server.metrics.registry
    long = engine.max_context - len(micro_prompts[1])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.VerifierStub(channel).Generate(
            pb.GenerateRequest(prompt_ids=micro_prompts[1], max_new_tokens=long),
            timeout=PATIENCE_S,
        )
        for _ in range(2):
            next(call)
        # Execute
        call.cancel()
    # Assert: dropped as abandoned (not run to its end), within far fewer steps than asked
    poll(lambda: len(engine.sessions) == 0, 5, "the cancelled stream's session to be freed")
    abandoned = registry.get_sample_value("fedge_verifier_abandoned_total", {"kind": "generate"})
    assert abandoned == 1.0
    steps = registry.get_sample_value("fedge_verifier_batch_size_count")
    assert steps is not None and steps < long // 2
