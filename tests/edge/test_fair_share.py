"""Fair shares in the single verifier, over real gRPC on 127.0.0.1 with per-device credentials:
nothing one device does with its own credential costs another device its sessions or its calls.

Each test plays one finding of issue 31 as the attacker would (bob, with a valid credential of
his own, against alice) and says in its docstring what the attack did before the fix.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from transformers import PreTrainedModel

from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.verifier.engine import EngineConfig, Sampling, VerifierEngine
from fedge.edge.verifier.jobs import NullObserver
from fedge.edge.verifier.limits import GENERATE, PREFILL, RateLimitConfig
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths
from tests.edge.harness import running_ingress, write_credentials
from tests.edge.test_engine import target_greedy
from tests.edge.test_liveness import poll

Auth = tuple[tuple[str, str], ...]
ROUNDS = 80  # alice's rounds beside bob's streams in the first test
PER_POSITION = 1024  # KV bytes of one position of the micro target (2 layers x 2 x 64 x fp32)


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Auth]]:
    """Credentials of alice (ordinary), bob (the noisy neighbour) and carol; each one's metadata."""
    path, tokens = write_credentials(tmp_path_factory.mktemp("creds"), ["alice", "bob", "carol"])
    return path, {d: (("authorization", f"Bearer {t}"),) for d, t in tokens.items()}


@contextmanager
def verifier(
    zoo: ZooPaths,
    model: PreTrainedModel,
    credentials: Path,
    engine: EngineConfig,
    limits: RateLimitConfig | None = None,
) -> Iterator[tuple[pb_grpc.VerifierStub, BackgroundServer]]:
    """A real verifier on 127.0.0.1:0 that knows the devices' credentials; its stub and itself."""
    config = ServerConfig(
        zoo.target_dir,
        credentials_file=credentials,
        drain_notice_s=0.0,
        engine=engine,
        **({} if limits is None else {"rate_limits": limits}),
    )
    with BackgroundServer(config, model) as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        yield pb_grpc.VerifierStub(channel), server
        channel.close()


def status(call: object) -> grpc.StatusCode:
    """OK, or the status a zero-argument call failed with."""
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as error:
        return error.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


@contextmanager
def noise() -> Iterator[threading.Event]:
    """A stop event for background threads, set however the test ends."""
    stop = threading.Event()
    try:
        yield stop
    finally:
        stop.set()


def background(stop: threading.Event, targets: list[object]) -> None:
    """Start each target on a daemon thread (it runs until `stop` is set)."""
    for target in targets:
        threading.Thread(target=target, daemon=True).start()  # type: ignore[arg-type]


def generate(stub: pb_grpc.VerifierStub, auth: Auth, prompt: list[int], tokens: int) -> int:
    """Tokens one Generate streamed before it ended (raises its error, if any)."""
    request = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=tokens)
    return sum(1 for _ in stub.Generate(request, metadata=auth))


def test_a_batch_never_evicts_another_owners_idle_session_for_its_own_growth(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, devices: tuple[Path, dict[str, Auth]]
) -> None:
    """Bob keeps 4 Generate streams running that outgrow the KV cap (300 positions); alice holds
    one idle session (`a-idle`, 20 tokens) and, for 80 rounds, opens and verifies a short one
    beside bob's streams, then checks on `a-idle`. Alice's growth never needs room (she holds
    ~25 of 300 positions), so her idle session stays and none of her calls is refused; bob's
    streams end RESOURCE_EXHAUSTED alone.

    Before the fix a batch made room among the idle sessions of every owner in it: bob's growth
    evicted `a-idle` 5 times in 80 rounds (its next verify NOT_FOUND) and alice's calls were
    refused RESOURCE_EXHAUSTED 7 times (the whole batch failed when bob's growth found no room)."""
    path, auth = devices
    alice, bob = auth["alice"], auth["bob"]
    engine = EngineConfig(max_draft=8, kv_cap_bytes=300 * PER_POSITION)
    with verifier(micro_zoo, micro_target, path, engine) as (stub, _), noise() as stop:
        idle = pb.VerifyRequest(session_id="a-idle", committed_ids=list(range(3, 23)))
        assert stub.Verify(idle, metadata=alice).HasField("opened")
        outcomes: list[grpc.StatusCode] = []

        def streams() -> None:
            while not stop.is_set():
                outcomes.append(status(lambda: generate(stub, bob, list(range(5, 13)), 100)))

        background(stop, [streams] * 4)
        evicted, refused = 0, []
        for index in range(ROUNDS):
            short = pb.VerifyRequest(session_id=f"a{index}", committed_ids=[7, 8, 9], draft_ids=[])
            for request in (short, pb.VerifyRequest(session_id="a-idle", draft_ids=[])):
                try:
                    stub.Verify(request, metadata=alice)
                except grpc.RpcError as error:
                    evicted += error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
                    refused.append(error.code())  # type: ignore[attr-defined]
            for sid in (f"a{index}", "a-idle"):
                status(
                    lambda s=sid: stub.CloseSession(
                        pb.CloseSessionRequest(session_id=s), metadata=alice
                    )
                )  # type: ignore[misc]
            code = status(lambda: stub.Verify(idle, metadata=alice))  # idle again, 20 tokens
            if code != grpc.StatusCode.OK:
                refused.append(code)
    assert (evicted, refused) == (0, [])
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in outcomes  # bob's own growth is what is refused


def test_an_owner_under_its_share_gets_kv_held_by_another_owners_idle_sessions(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, devices: tuple[Path, dict[str, Auth]]
) -> None:
    """Bob's 2 idle sessions hold 1,044,480 of the 1,048,576 KV bytes. Alice's 511-token open
    is within her fair share (half the cap with two owners): it evicts bob's least recently used
    idle session and opens. Bob's next long open then makes room among his own sessions only.

    Before the fix alice's open was refused RESOURCE_EXHAUSTED (admission evicted only the
    caller's own idle sessions; alice had none)."""
    path, auth = devices
    alice, bob = auth["alice"], auth["bob"]
    long_prompt = [3 + i % 900 for i in range(511)]
    engine = EngineConfig(max_draft=8, kv_cap_bytes=1 << 20)
    with verifier(micro_zoo, micro_target, path, engine) as (stub, server):
        assert server.server is not None and server.server.engine is not None
        sessions = server.server.engine.sessions
        held = [
            stub.OpenSession(pb.OpenSessionRequest(prompt_ids=long_prompt), metadata=bob).session_id
            for _ in range(2)
        ]
        assert sessions.total_bytes == 1_044_480
        mine = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=long_prompt), metadata=alice)
        first, second = (pb.VerifyRequest(session_id=sid) for sid in held)
        assert status(lambda: stub.Verify(first, metadata=bob)) == (
            grpc.StatusCode.NOT_FOUND  # bob's LRU idle session gave way
        )
        again = pb.OpenSessionRequest(prompt_ids=long_prompt)
        assert status(lambda: stub.OpenSession(again, metadata=bob)) == grpc.StatusCode.OK
        assert status(lambda: stub.Verify(second, metadata=bob)) == (
            grpc.StatusCode.NOT_FOUND  # over his share, bob made room among his own
        )
        follow = pb.VerifyRequest(session_id=mine.session_id, draft_ids=[])
        assert stub.Verify(follow, metadata=alice).session_length == 512


def test_a_configured_kv_quota_caps_one_device_whatever_room_is_free(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, devices: tuple[Path, dict[str, Auth]]
) -> None:
    """With a per-device KV quota of 100 positions (of a 1,024-position cap), bob's 200-token
    open is refused though the cap is empty, and his second 60-token open makes room among his
    own sessions (his first goes); alice's open beside him passes.

    Before the fix there was no per-device KV limit to configure (only the shared cap): bob's
    200-token open took 199 of the 1,024 positions."""
    path, auth = devices
    alice, bob = auth["alice"], auth["bob"]
    engine = EngineConfig(
        max_draft=8, kv_cap_bytes=1 << 20, kv_cap_per_token_bytes=100 * PER_POSITION
    )
    with verifier(micro_zoo, micro_target, path, engine) as (stub, _):
        big = pb.OpenSessionRequest(prompt_ids=[3 + i for i in range(200)])
        assert status(lambda: stub.OpenSession(big, metadata=bob)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        small = pb.OpenSessionRequest(prompt_ids=[3 + i for i in range(60)])
        first = stub.OpenSession(small, metadata=bob).session_id
        stub.OpenSession(small, metadata=bob)
        peek = pb.VerifyRequest(session_id=first)
        assert status(lambda: stub.Verify(peek, metadata=bob)) == grpc.StatusCode.NOT_FOUND
        assert stub.OpenSession(small, metadata=alice).session_id


def test_a_device_filling_the_session_table_cannot_refuse_another_with_defaults(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, devices: tuple[Path, dict[str, Auth]]
) -> None:
    """Bob opens 40 idle sessions on a verifier of 32 with no quota option set: the per-device
    quota is on by default, so bob holds at most its default (his own oldest give way) and
    alice's open passes. With the quota turned off explicitly (0), bob fills all 32, and alice's
    open still passes: she is under her fair share of the table, so bob's LRU idle one goes.

    Before the fix the quota was off unless set: bob held all 32 sessions and alice's
    OpenSession was refused RESOURCE_EXHAUSTED ("none idle of this device's own")."""
    path, auth = devices
    alice, bob = auth["alice"], auth["bob"]
    for quota in (None, 0):
        options = {} if quota is None else {"max_sessions_per_token": quota}
        engine = EngineConfig(max_draft=8, max_sessions=32, **options)  # type: ignore[arg-type]
        with verifier(micro_zoo, micro_target, path, engine) as (stub, server):
            assert server.server is not None and server.server.engine is not None
            for index in range(40):
                request = pb.VerifyRequest(session_id=f"b{index}", committed_ids=[4, 5, 6])
                stub.Verify(request, metadata=bob)
            held = len(server.server.engine.sessions)
            assert held == (32 if quota == 0 else engine.sessions_per_owner)
            opened = pb.OpenSessionRequest(prompt_ids=[7, 8])
            assert stub.OpenSession(opened, metadata=alice).session_id  # not refused


def test_generate_prompts_pay_prefill_and_generate_is_metered_by_default(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel, devices: tuple[Path, dict[str, Auth]]
) -> None:
    """With a prefill budget of 1 token/s (burst 16) and no Generate rate set, bob's 120-token
    open leaves his bucket in debt and his next open is refused; a Generate with a 120-token
    prompt is refused too (it prefills as much), while alice's passes. With no rate option at all
    the verifier meters Generate and prefill per device: a Generate asking more tokens than the
    default per-device burst is refused by the meter.

    Before the fix a Generate's prompt was never charged: bob streamed 5 of 5 Generates of
    120-token prompts right after his open was refused, and with no option set there was no
    limiter at all (a Generate cost nothing)."""
    path, auth = devices
    alice, bob = auth["alice"], auth["bob"]
    prompt = [3 + i for i in range(120)]
    limits = RateLimitConfig(prefill_rate=1.0, prefill_burst=16)
    with verifier(micro_zoo, micro_target, path, EngineConfig(max_draft=8), limits) as (stub, _):
        first = pb.OpenSessionRequest(prompt_ids=prompt)
        assert status(lambda: stub.OpenSession(first, metadata=bob)) == grpc.StatusCode.OK
        assert status(lambda: stub.OpenSession(first, metadata=bob)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        streamed = [status(lambda: generate(stub, bob, prompt, 2)) for _ in range(5)]
        assert streamed == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 5
        assert generate(stub, alice, prompt, 2) == 2  # alice's own bucket pays hers
    with verifier(micro_zoo, micro_target, path, EngineConfig(max_draft=8)) as (stub, server):
        assert server.server is not None
        limiter = server.server.limiter
        assert limiter is not None and {GENERATE, PREFILL} <= set(limiter.buckets)
        burst = limiter.buckets[GENERATE].burst
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, bob, prompt[:8], burst + 1)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "per-device burst" in refused.value.details()  # type: ignore[attr-defined]
        assert generate(stub, bob, prompt[:30], 20) == 20


def test_the_fleet_ingress_charges_generate_prompts_as_prefill_as_the_verifier_does(
    devices: tuple[Path, dict[str, Auth]],
) -> None:
    """The same attack as above through the fleet's ingress (its real gRPC server, credentials
    and limits; no replica behind it, so every relayed call ends UNAVAILABLE): bob's 120-token
    open leaves his prefill bucket (1 token/s, burst 16) in debt, then each of his 5 Generates
    of a 120-token prompt is refused RESOURCE_EXHAUSTED before it is relayed, while alice's
    Generate of that prompt passes the meter (relayed: UNAVAILABLE here). With no limit option
    the ingress meters Generate and prefill per device, as the single verifier does.

    The ingress and the verifier share `RateLimitInterceptor` (`_generate_costs`), so this held
    before this test too; it pins the fleet path to the verifier's charge (issue 31, item 4)."""
    path, auth = devices
    alice, bob = auth["alice"], auth["bob"]
    prompt = [3 + i for i in range(120)]
    limits = RateLimitConfig(prefill_rate=1.0, prefill_burst=16)
    spec = IngressSpec("fedge-v1", credentials_file=path, rate_limits=limits)
    with running_ingress(spec) as (front, replicas):
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{front.port()}"))
        first = pb.OpenSessionRequest(prompt_ids=prompt)
        assert status(lambda: stub.OpenSession(first, metadata=bob)) == grpc.StatusCode.UNAVAILABLE
        relayed = len(replicas.relayed)
        assert status(lambda: stub.OpenSession(first, metadata=bob)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        streamed = [status(lambda: generate(stub, bob, prompt, 2)) for _ in range(5)]
        assert streamed == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 5
        assert len(replicas.relayed) == relayed  # nothing of bob's reached a replica
        assert status(lambda: generate(stub, alice, prompt, 2)) == grpc.StatusCode.UNAVAILABLE
    with running_ingress(IngressSpec("fedge-v1", credentials_file=path)) as (front, _):
        assert front.limits.current is not None
        assert {GENERATE, PREFILL} <= set(front.limits.current._limiter.buckets)  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noisy_owner_never_refuses_or_evicts_an_ordinary_owner_under_its_share(
    seed: int,
    micro_zoo: ZooPaths,
    micro_target: PreTrainedModel,
    devices: tuple[Path, dict[str, Auth]],
) -> None:
    """Bob, in 3 threads, does seeded random operations within his credential: opens
    (1-60 tokens), verifies of random drafts on his sessions, Generates (up to 60 new tokens),
    closes and idle pauses, on a verifier of 10 sessions and 200 KV positions. Alice, beside him,
    keeps 2 sessions under her fair share (each at most 40 positions) and verifies, closes and
    reopens them: none of her calls is refused and none of her sessions is evicted.

    Before the fix alice's calls failed 6, 7 and 1 times with seeds 0, 1, 2 (RESOURCE_EXHAUSTED
    when bob held the table or the KV cap, NOT_FOUND when bob's growth evicted her idle session)."""
    path, auth = devices
    alice, bob = auth["alice"], auth["bob"]
    engine = EngineConfig(max_draft=8, max_sessions=10, kv_cap_bytes=200 * PER_POSITION)
    with verifier(micro_zoo, micro_target, path, engine) as (stub, _), noise() as stop:
        noisy_codes: list[grpc.StatusCode] = []

        def noisy(worker: int) -> None:
            rng = random.Random(seed * 100 + worker)
            mine: list[str] = []
            step = 0
            while not stop.is_set():
                step += 1
                kind = rng.choice(["open", "open", "verify", "verify", "generate", "idle", "close"])
                if kind == "open":
                    sid = f"b{worker}-{step}"
                    size = rng.randint(1, 60)
                    request = pb.VerifyRequest(
                        session_id=sid, committed_ids=[rng.randrange(2, 1000) for _ in range(size)]
                    )
                    code = status(lambda r=request: stub.Verify(r, metadata=bob))  # type: ignore[misc]
                    if code == grpc.StatusCode.OK:
                        mine.append(sid)
                elif kind == "verify" and mine:
                    draft = [rng.randrange(2, 1000) for _ in range(rng.randint(0, 8))]
                    request = pb.VerifyRequest(session_id=rng.choice(mine), draft_ids=draft)
                    code = status(lambda r=request: stub.Verify(r, metadata=bob))  # type: ignore[misc]
                elif kind == "generate":
                    prompt = [rng.randrange(2, 1000) for _ in range(rng.randint(1, 40))]
                    tokens = rng.randint(1, 60)
                    code = status(lambda p=prompt, t=tokens: generate(stub, bob, p, t))  # type: ignore[misc]
                elif kind == "close" and mine:
                    sid = mine.pop(rng.randrange(len(mine)))
                    request = pb.CloseSessionRequest(session_id=sid)  # type: ignore[assignment]
                    code = status(lambda r=request: stub.CloseSession(r, metadata=bob))  # type: ignore[misc]
                else:
                    time.sleep(rng.uniform(0.0, 0.02))
                    code = grpc.StatusCode.OK
                noisy_codes.append(code)

        background(stop, [lambda w=w: noisy(w) for w in range(3)])
        failures: list[tuple[str, grpc.StatusCode]] = []
        rng = random.Random(seed)
        lengths = {"a0": 0, "a1": 0}
        for _ in range(ROUNDS):
            for sid in lengths:
                if lengths[sid] == 0 or lengths[sid] > 32:
                    if lengths[sid]:
                        close = pb.CloseSessionRequest(session_id=sid)
                        stub.CloseSession(close, metadata=alice)
                    request = pb.VerifyRequest(
                        session_id=sid, committed_ids=[rng.randrange(2, 1000) for _ in range(8)]
                    )
                else:
                    draft = [rng.randrange(2, 1000) for _ in range(rng.randint(0, 4))]
                    request = pb.VerifyRequest(session_id=sid, draft_ids=draft)
                try:
                    lengths[sid] = stub.Verify(request, metadata=alice).session_length
                except grpc.RpcError as error:
                    failures.append((sid, error.code()))  # type: ignore[attr-defined]
                    lengths[sid] = 0  # reopen next round
            time.sleep(rng.uniform(0.0, 0.01))
    assert failures == []
    assert grpc.StatusCode.OK in noisy_codes  # bob did get work done within his share


class BatchSizes(NullObserver):
    """Records the size of every forward the engine runs."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_batch(self, size: int, seconds: float) -> None:
        self.sizes.append(size)


def test_a_step_gives_no_owner_more_rows_than_the_next_largest_demand(
    micro_target: PreTrainedModel, micro_prompts: list[list[int]]
) -> None:
    """Bob runs 6 Generate streams of 200 tokens; alice starts one of 40 beside them. While both
    run, a step holds alice's row and one of bob's (his others wait their turn), so his streams
    do not make alice's steps longer; alone, bob's streams share every step; every stream ends
    with all its tokens, exactly greedy.

    Before the fix every step held every row: alice's 40 steps were 7 rows wide (none of 2)."""
    observer = BatchSizes()
    engine = VerifierEngine(micro_target, EngineConfig(max_draft=8), observer=observer).start()
    try:
        bobs = [
            engine.submit_generate(micro_prompts[4], 200, Sampling(), owner="bob") for _ in range(6)
        ]
        poll(lambda: 6 in observer.sizes, 60.0, "bob's streams batched")
        alice = engine.submit_generate(micro_prompts[2], 40, Sampling(), owner="alice")
        alice_tokens = list(alice)
        during = list(observer.sizes)
        bob_tokens = [list(stream) for stream in bobs]
    finally:
        engine.stop()
    assert alice_tokens == target_greedy(micro_target, micro_prompts[2], 40)
    assert bob_tokens == [target_greedy(micro_target, micro_prompts[4], 200)] * 6
    assert during.count(2) >= 30  # alice's steps: her row and one of bob's
    assert 7 not in observer.sizes
