"""The fleet's shared state on a real Redis server: several ingresses agree, a rebuilt one carries on.

No Ray here: the ingress's routing logic (`IngressState`) and the real ingress class
(`running_ingress`, its gRPC server outside Serve) run against a real redis-server on
127.0.0.1 (`fresh_redis`, tests/conftest.py), emptied before each test; where calls must
reach a model, in front of real verifier replicas (`LocalReplicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.fleet.app import FleetConfig
from fedge.edge.fleet.ingress import IngressSpec
from fedge.edge.fleet.ingress_state import IngressState
from fedge.edge.fleet.redis_state import RedisState
from fedge.edge.fleet.rollout import recovery
from fedge.edge.fleet.state import MemoryState, Routing
from fedge.edge.fleet.stats import CallOutcome
from fedge.edge.fleet.wire import CallResult
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.limits import VERIFY, RateLimiter
from fedge.edge.verifier.rate_config import RateLimitConfig
from fedge.edge.verifier.requests import Sampling
from fedge.simulations.local_services import RedisServer
from fedge.simulations.netem import NetworkEmulator
from fedge.zoo import ZooPaths
from tests.architectures import greedy_reference
from tests.edge.harness import LocalIngress, LocalReplicas, ReplicaHandle, running_ingress
from tests.fleet.harness import wait_for

V1_LIMITS = RateLimitConfig(verify_rate=1.0, verify_burst=10)
DEVICES = 4  # the Service spreads their connections over both ingresses: two on each
NEW_TOKENS = 24
ENDPOINT_REMOVAL_S = 0.5  # a dead pod stays in the Service's endpoints this long (new
# connections to it are reset meanwhile), as until Kubernetes marks it not ready


def ingress_state(server: RedisServer, epoch: str = "deploy-1") -> IngressState:
    """One ingress's state over its own connection, as deployed: stable fedge-v1 at V1_LIMITS."""
    store = RedisState.connect(server.url, server.password_file)
    return IngressState(store, Routing("fedge-v1", limits=V1_LIMITS), b"fleet-v1", epoch)


def test_two_ingresses_agree_on_a_sessions_home_and_share_a_devices_budget(
    fresh_redis: RedisServer,
) -> None:
    """Ingress A learns alice's session; ingress B routes it to the same replica (mallory naming
    it gets a new session). A device alternating between the ingresses, 40 verifies of 1 token
    as fast as it can, is granted its burst of 10 plus what 1 token/s refills meanwhile, not
    twice that.

    On main each ingress kept its map and buckets in its own memory: B did not know the session
    and each ingress granted the device a full burst (20 of 40): run, as the last assertion,
    with two in-process stores (main itself has no store to point at)."""

    async def scenario() -> tuple[int, float, int]:
        a, b = ingress_state(fresh_redis), ingress_state(fresh_redis)
        await a.start()
        await b.start()
        await a.remember("Verify", "s1", "fedge-v1", CallResult("OK", replica="r1"), "alice")
        assert await b.target("s1", "alice") == ("fedge-v1", "r1")
        assert await b.target("s1", "mallory") == ("fedge-v1", "")
        limiters = [RateLimiter(V1_LIMITS, shared=s.store.buckets) for s in (a, b)]
        started = time.monotonic()
        granted = 0
        for i in range(40):
            granted += await limiters[i % 2].buckets[VERIFY].take("id:alice", 1) == 0.0
        elapsed = time.monotonic() - started
        separate = [RateLimiter(V1_LIMITS, shared=MemoryState().buckets) for _ in range(2)]
        apart = 0
        for i in range(40):
            apart += await separate[i % 2].buckets[VERIFY].take("id:alice", 1) == 0.0
        await a.store.close()
        await b.store.close()
        return granted, elapsed, apart

    granted, elapsed, apart = asyncio.run(scenario())
    assert 10 <= granted <= 10 + int(elapsed * V1_LIMITS.verify_rate) + 1
    assert apart >= 20  # two separate stores: a full burst at each


def test_an_ingress_rebuilt_after_a_promotion_serves_the_live_app_adapter_and_limits(
    fresh_redis: RedisServer,
) -> None:
    """A real ingress (its gRPC server, over Redis) promotes fedge-v2 with a new fleet config
    and changes the limits; it dies (the old fedge-v1 is deleted after the promotion) and is
    rebuilt from the same deployment spec, which still names fedge-v1. The rebuilt ingress sends
    new sessions and a session homed on fedge-v1 to fedge-v2, reports the promoted config and
    charges the new limits. A fresh deployment (a new epoch) starts from its own declaration.

    On main the rebuilt ingress came back from its spec: stable fedge-v1 (deleted: every call
    failed), the old fleet config (the next restart redeployed the old adapter) and the old
    limits. Run: the same steps with the state in the ingress's memory, as on main, gave
    stable fedge-v1, b"fleet-v1" and the old limits (main itself has no store to point at).
    The first ingress stops cleanly here; it writes nothing on the way out, so a crash is
    the same."""
    spec = IngressSpec(
        "fedge-v1",
        fleet=b"fleet-v1",
        rate_limits=V1_LIMITS,
        redis_url=fresh_redis.url,
        redis_password_file=fresh_redis.password_file,
    )
    new_limits = RateLimitConfig(verify_rate=5.0, verify_burst=20)
    with running_ingress(spec) as (front, _):
        front.call(front.state.remember("Verify", "s1", "fedge-v1", CallResult("OK", replica="r1")))
        front.call(front.promote("fedge-v2", b"fleet-v2"))
        front.call(front.set_rate_limits(new_limits))
    with running_ingress(spec) as (rebuilt, _):
        assert rebuilt.call(rebuilt.describe())["stable"] == "fedge-v2"
        assert rebuilt.call(rebuilt.state.target("new")) == ("fedge-v2", "")
        assert rebuilt.call(rebuilt.state.target("s1")) == ("fedge-v2", "")  # not its dead home
        assert rebuilt.call(rebuilt.fleet_config()) == b"fleet-v2"
        assert rebuilt.limits.config == new_limits
        assert rebuilt.limits.current is not None
        assert rebuilt.limits.current._limiter.buckets[VERIFY].burst == 20
    redeployed = IngressSpec(
        "fedge-v1", redis_url=fresh_redis.url, redis_password_file=fresh_redis.password_file
    )
    with running_ingress(redeployed) as (again, _):
        assert again.call(again.describe())["stable"] == "fedge-v1"
        assert again.call(again.fleet_config()) == b""


def test_an_ingress_killed_mid_rollout_resumes_the_canary_or_cleanly_rolls_back(
    fresh_redis: RedisServer,
) -> None:
    """Ingress A runs a canary (fedge-v2 at 50%, figures recorded) and dies. Rebuilt, it keeps
    the split and the figures, so the controller's observation goes on; a controller that died
    too is resolved by `recovery`: rolled back, after which no call goes to fedge-v2. Killed after
    the promotion but before the progress said so, the rebuilt ingress routes everything (a
    session homed on fedge-v1 included) to fedge-v2 and recovery finishes: fedge-v1 is deleted.

    On main a restart mid-rollout lost the canary (no split, `arm_stats` raised KeyError in the
    controller) and left the canary application deployed (read). Run: with the state in the
    ingress's memory, as on main, the rebuilt ingress had no canary and no figures."""

    async def scenario() -> None:
        a = ingress_state(fresh_redis)
        await a.start()
        await a.set_rollout({"stable": "fedge-v1", "canary": "fedge-v2", "phase": "observing"})
        await a.set_canary("fedge-v2", 0.5)
        await a.remember("Verify", "old", "fedge-v1", CallResult("OK", replica="r1"))
        for app in ("fedge-v1", "fedge-v2"):
            await a.observe(app, CallOutcome("Verify", "OK", 0.01, 4, 3, f"{app}-s"))
        await a.store.close()

        b = ingress_state(fresh_redis)
        await b.start()
        assert await b.describe() == {"stable": "fedge-v1", "canary": "fedge-v2", "fraction": 0.5}
        figures = await b.arm_stats()
        assert figures["fedge-v2"]["verifies"] == 1 and figures["fedge-v2"]["accepted"] == 3
        picks = {(await b.target(f"n{i}"))[0] for i in range(64)}
        assert picks == {"fedge-v1", "fedge-v2"}  # P(one arm only) = 2 * 2^-64

        plan = recovery(await b.rollout(), await b.describe())
        assert plan == ("rollback", "fedge-v2")
        await b.set_canary(None)
        await b.set_rollout(None)
        assert {(await b.target(f"m{i}"))[0] for i in range(32)} == {"fedge-v1"}

        await b.set_rollout({"stable": "fedge-v1", "canary": "fedge-v2", "phase": "observing"})
        await b.set_canary("fedge-v2", 0.5)
        await b.promote("fedge-v2", b"fleet-v2")
        await b.store.close()

        c = ingress_state(fresh_redis)
        await c.start()
        assert await c.target("old") == ("fedge-v2", "")
        assert {(await c.target(f"k{i}"))[0] for i in range(32)} == {"fedge-v2"}
        assert recovery(await c.rollout(), await c.describe()) == ("finish", "fedge-v1")
        await c.store.close()

    asyncio.run(scenario())


def test_admin_changes_through_two_ingresses_do_not_undo_each_other(
    fresh_redis: RedisServer,
) -> None:
    """Ingress B, whose last read of the routing predates A's canary, sets new limits: the canary
    stays. Run with the whole routing written back (B's stale copy, as this branch first did):
    the canary was gone (fraction 0.0)."""

    async def scenario() -> None:
        a, b = ingress_state(fresh_redis), ingress_state(fresh_redis)
        await a.start()
        await b.start()
        stale = b.routing
        await a.set_canary("fedge-v2", 0.25)
        limits = RateLimitConfig(verify_rate=3.0, verify_burst=12)
        await b.store.set_routing(replace(stale, limits=limits), fields=("limits",))
        assert await b.describe() == {"stable": "fedge-v1", "canary": "fedge-v2", "fraction": 0.25}
        assert b.routing.limits == limits
        await a.store.close()
        await b.store.close()

    asyncio.run(scenario())


def test_the_redis_url_refuses_a_password_and_the_password_file_must_exist(
    tmp_path: Path,
) -> None:
    """A password belongs in the password file, not in a URL that shows up in configs and logs;
    a TLS URL may not turn off the check of Redis's certificate (the password would go to a
    stand-in); a missing password file is named; several ingresses without a shared store are
    refused."""
    with pytest.raises(ValueError, match="password file"):
        IngressSpec("fedge-v1", redis_url="redis://:hunter2@127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="redis://HOST"):
        IngressSpec("fedge-v1", redis_url="http://127.0.0.1:6379")
    for unchecked in ("ssl_cert_reqs=none", "ssl_cert_reqs=optional", "ssl_check_hostname=false"):
        with pytest.raises(ValueError, match="turns off the check of Redis's TLS certificate"):
            IngressSpec("fedge-v1", redis_url=f"rediss://fedge@redis:6379/0?{unchecked}")
    IngressSpec("fedge-v1", redis_url="rediss://fedge@redis:6379/0?ssl_ca_certs=/run/ca.crt")
    with pytest.raises(ValueError, match="missing"):
        RedisState.connect("redis://127.0.0.1:1/0", tmp_path / "nope")
    with pytest.raises(ValueError, match="ingress_replicas=2 needs redis_url"):
        FleetConfig(tmp_path, ingress_replicas=2)  # each ingress would hold its own state


@dataclass
class Fleet:
    """Two ingresses over one Redis in front of `replicas`, behind one `service` address."""

    replicas: LocalReplicas
    handle_a: ReplicaHandle  # ingress A's deployment handle (hold its answers with it)
    a: LocalIngress
    b: LocalIngress
    service: NetworkEmulator

    def kill_a(self) -> None:
        """Ingress A's pod dies: its connections, and new ones to it, are reset; its relays end
        unanswered; the Service drops it `ENDPOINT_REMOVAL_S` later."""
        self.service.cut(self.a.port())
        self.a.call(self.a.server.stop(None))
        self.handle_a.holding.clear()
        time.sleep(ENDPOINT_REMOVAL_S)
        self.service.spread([self.b.port()])

    def kill_a_under(self, device: Callable[[], object], held: str) -> list[str]:
        """Run one `device` in a thread with A's answers held; once one is (`held` names it), A
        dies. Returns what the device raised (every failure is a finding of the test)."""
        failures: list[str] = []

        def run() -> None:
            try:
                device()
            except Exception as error:
                failures.append(repr(error))

        self.handle_a.holding.set()
        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: self.handle_a.held == 1, 10, held)
        self.kill_a()
        thread.join(timeout=60)
        return failures


@contextlib.contextmanager
def fleet_behind_a_service(redis: RedisServer, zoo: ZooPaths) -> Iterator[Fleet]:
    """Two real verifier replicas, ingresses A and B over one Redis, and a Service spreading new
    connections over A then B in turn."""
    spec = IngressSpec("fedge-v1", redis_url=redis.url, redis_password_file=redis.password_file)
    with contextlib.ExitStack() as stack:
        replicas = stack.enter_context(LocalReplicas(zoo.target_dir, 2))
        handle_a = replicas.handle("A")
        a, _ = stack.enter_context(running_ingress(spec, handle_a))
        b, _ = stack.enter_context(running_ingress(spec, replicas.handle("B")))
        service = stack.enter_context(NetworkEmulator(a.port()))
        service.spread([a.port(), b.port()])
        yield Fleet(replicas, handle_a, a, b, service)


def decode_through(
    port: int,
    device: str,
    draft: PreTrainedModel,
    prompt: list[int],
    after_first: Callable[[], object] = lambda: None,
) -> tuple[list[int], VerifierClient]:
    """One device's speculative decode (its own channel) of `prompt` through the Service at `port`;
    `after_first` runs once its first verify is answered."""
    tokens: list[int] = []
    with VerifierClient(ClientConfig(f"127.0.0.1:{port}", device_id=device)) as client:
        decoder = SpeculativeDecoder(
            TorchDraftRuntime(draft), client, DecodeConfig(max_new_tokens=NEW_TOKENS)
        )
        for chunk in decoder.stream(prompt):
            if not tokens:
                after_first()
            tokens += chunk
    return tokens, client


def test_an_ingress_killed_mid_decode_fails_no_request_and_its_sessions_stay_home(
    fresh_redis: RedisServer,
    micro_zoo: ZooPaths,
    models: tuple[PreTrainedModel, PreTrainedModel],
    prompts: list[list[int]],
) -> None:
    """Two ingresses over one Redis in front of two real verifier replicas; four devices decode
    speculatively through one address that spreads connections over the ingresses, as a
    Kubernetes Service does (`NetworkEmulator.spread`). Each device's session is open (one
    verify done) when ingress A's next replies are held: each of A's devices has a verify
    applied on its replica and unanswered. Then A dies: its connections are reset (what the
    kernel does to a dead pod's), its server stops without grace, and for half a second the
    Service still sends new connections to it (they are reset). Every device finishes its
    request with the target's own greedy continuation; A's devices reconnect through B, which
    finds their sessions' homes in Redis and sends them to the same replica (no reopen: the
    retried verify is replayed there, not prefilled again). Both ingresses give a session's
    calls one routing key (`ROUTE_SESSION`, by which routers count sessions), never its id.

    A regression guard of the promise in docs/fleet.md ("Shared state"), not a bug found: the
    fleet kept it on main. Its first run failed only its own check that the devices were
    spread: all four reached A, because gRPC shares one TCP connection among a process's
    channels to one address (now each edge client has its own, as each phone does). It fails
    when the property breaks (run): with B keeping its own state (no `redis_url`) a session
    of A's was reopened on the replica B picked (`reopens` 1, three runs of three); devices
    that do not retry UNAVAILABLE (`unreachable_after_s=0`) failed with VerifierUnreachable.
    """
    target, draft = models
    chosen = prompts[:DEVICES]
    expected = [greedy_reference(target, prompt, NEW_TOKENS) for prompt in chosen]
    ready, go = threading.Barrier(DEVICES + 1), threading.Event()
    outcomes: dict[str, tuple[list[int], VerifierClient]] = {}
    failures: list[str] = []

    def pause() -> None:
        ready.wait(timeout=60)
        go.wait(timeout=60)

    with fleet_behind_a_service(fresh_redis, micro_zoo) as fleet:

        def device(index: int) -> None:
            name = f"device-{index}"
            try:
                port = fleet.service.port
                outcomes[name] = decode_through(port, name, draft, chosen[index], pause)
            except Exception as error:  # every failure is a finding of the test
                failures.append(f"{name}: {error!r}")
                ready.abort()

        threads = [threading.Thread(target=device, args=(i,)) for i in range(DEVICES)]
        for thread in threads:
            thread.start()
        ready.wait(timeout=60)  # every session open, homed on a replica
        relayed = fleet.replicas.relayed
        via_a = {r.device for r in relayed if r.ingress == "A"}
        fleet.handle_a.holding.set()
        go.set()
        wait_for(lambda: fleet.handle_a.held == len(via_a), 10, "a verify of each A device held")
        killed_at = len(relayed)
        fleet.kill_a()
        for thread in threads:
            thread.join(timeout=60)

    assert failures == []
    assert 0 < len(via_a) < DEVICES  # the Service spread the devices over both ingresses
    for index in range(DEVICES):
        tokens, client = outcomes[f"device-{index}"]
        assert tokens == expected[index], f"device-{index} decoded other tokens"
        assert client.reopens == 0  # no session was lost and prefilled again
    after = [r for r in relayed[killed_at:] if r.method == "Verify"]
    for name in via_a:
        assert outcomes[name][1].retries >= 1  # it felt A's death
        continued = [r for r in after if r.device == name]
        assert {r.ingress for r in continued} == {"B"}
        assert all(r.home == r.replica for r in continued), f"B did not know {name}'s home"
        homes = {r.replica for r in relayed if r.device == name and r.method == "Verify"}
        assert len(homes) == 1, f"{name}'s session moved between replicas: {homes}"
        keys = {(r.session, r.key) for r in relayed if r.device == name and r.method == "Verify"}
        (session, key), *others = keys  # both ingresses give the session one routing key,
        assert others == [] and key and session not in key  # and never its id


def test_an_ingress_killed_while_a_devices_first_open_is_unanswered_fails_no_request(
    fresh_redis: RedisServer,
    micro_zoo: ZooPaths,
    models: tuple[PreTrainedModel, PreTrainedModel],
    prompts: list[list[int]],
) -> None:
    """A device's first call is a real OpenSession (it learns the verifier's limits); it goes
    through ingress A (the Service's first turn), a replica opens the session, and A dies
    before the answer is out. The device's request completes through B with the target's
    greedy continuation.

    On main it failed: the client retried a verify's UNAVAILABLE but not an OpenSession's,
    so the device's request raised UNAVAILABLE ("Connection reset by peer"; the edge's
    EdgeClient would have finished it on the draft alone). Now an OpenSession is retried
    as a verify is; the session the lost attempt opened expires unused at its time-to-live.
    """
    target, draft = models
    outcome: list[tuple[list[int], VerifierClient]] = []
    with fleet_behind_a_service(fresh_redis, micro_zoo) as fleet:
        port = fleet.service.port
        failures = fleet.kill_a_under(
            lambda: outcome.append(decode_through(port, "device-0", draft, prompts[0])),
            "the OpenSession answered, held in A",
        )

    assert failures == []
    assert [(r.ingress, r.method) for r in fleet.replicas.relayed[:1]] == [("A", "OpenSession")]
    assert outcome[0][0] == greedy_reference(target, prompts[0], NEW_TOKENS)


def test_an_ingress_killed_mid_generate_stream_fails_no_request(
    fresh_redis: RedisServer,
    micro_zoo: ZooPaths,
    models: tuple[PreTrainedModel, PreTrainedModel],
    prompts: list[list[int]],
) -> None:
    """A device decodes cloud-only: one Generate stream through ingress A (the Service's first
    turn). After three tokens reached the device, A holds the fourth and dies. The device's
    request completes through B with the target's greedy continuation, every token once.

    On main it failed: the ingress resumes a stream cut by a replica's death, but nothing
    resumed one cut by the ingress's own: the device's stream raised UNAVAILABLE ("Connection
    reset by peer"; EdgeClient would have finished the request on the draft alone). Now the
    client resumes it from the prompt plus the tokens streamed, as the ingress does.
    """
    target, _ = models
    streamed: list[int] = []
    with fleet_behind_a_service(fresh_redis, micro_zoo) as fleet:
        config = ClientConfig(f"127.0.0.1:{fleet.service.port}", device_id="device-0")

        def device() -> None:
            with VerifierClient(config) as client:
                streamed.extend(client.generate(prompts[0], NEW_TOKENS))

        fleet.handle_a.pass_messages = 1
        failures = fleet.kill_a_under(device, "the stream's second reply held in A")

    assert failures == []
    assert streamed == greedy_reference(target, prompts[0], NEW_TOKENS)
    assert [r.ingress for r in fleet.replicas.relayed if r.method == "Generate"] == ["A", "B"]


def test_a_sampled_generate_cut_with_its_ingress_resumes_the_same_draws(
    fresh_redis: RedisServer,
    micro_zoo: ZooPaths,
    models: tuple[PreTrainedModel, PreTrainedModel],
    prompts: list[list[int]],
) -> None:
    """The mid-Generate death above, sampling at temperature 0.9: the stream A cut and the
    client resumed through B streams exactly the tokens an uncut stream with the same seed
    does (the verifier draws by position, so the resumed request, prompt plus the tokens
    streamed, continues the same draws), and they are not the greedy ones.

    A regression guard (the resume passed on main, where only the greedy case was tested):
    it fails when the resumed request draws afresh (run: the resume sent with seed + 1 gave
    other tokens after the cut).
    """
    target, _ = models
    sampling = Sampling(temperature=0.9, seed=7)
    streamed: list[int] = []
    with fleet_behind_a_service(fresh_redis, micro_zoo) as fleet:
        config = ClientConfig(f"127.0.0.1:{fleet.service.port}", device_id="device-0")

        def device() -> None:
            with VerifierClient(config) as client:  # the Service's first turn: A
                streamed.extend(client.generate(prompts[0], NEW_TOKENS, sampling))

        fleet.handle_a.pass_messages = 1
        failures = fleet.kill_a_under(device, "the sampled stream's second reply held in A")
        with VerifierClient(config) as client:  # uncut, through B
            uncut = list(client.generate(prompts[0], NEW_TOKENS, sampling))

    assert failures == []
    assert streamed == uncut
    assert uncut != greedy_reference(target, prompts[0], NEW_TOKENS)
    generates = [r.ingress for r in fleet.replicas.relayed if r.method == "Generate"]
    assert generates == ["A", "B", "B"]  # cut in A, resumed through B; then the uncut one


def test_a_close_lost_with_its_ingress_is_sent_again_and_frees_the_session(
    fresh_redis: RedisServer, micro_zoo: ZooPaths, prompts: list[list[int]]
) -> None:
    """A device opens a session through ingress A (the Service's first turn); its CloseSession
    reaches A, and A dies before relaying it. The device's next call (an open, through B)
    sends the close again: the replica that held the session holds only the new one.

    On main the close was fire-and-forget and never sent again (run): the replica kept the
    first session (two open sessions after the second open) until its time-to-live, its
    memory and the device's session quota taken meanwhile.
    """
    with fleet_behind_a_service(fresh_redis, micro_zoo) as fleet:
        config = ClientConfig(f"127.0.0.1:{fleet.service.port}", device_id="device-0")
        with VerifierClient(config) as client:
            first = client.open(prompts[0])
            home = fleet.replicas.relayed[-1].replica
            replica = fleet.replicas.replicas[home]
            assert replica.open_sessions() == 1
            fleet.handle_a.stalling.set()  # A takes the close and dies before relaying it
            client.close(first.session_id)
            wait_for(lambda: fleet.handle_a.stalled == 1, 10, "the close to reach A")
            fleet.kill_a()
            wait_for(lambda: not client._in_flight, 10, "the close to end")
            assert [r.method for r in fleet.replicas.relayed] == ["OpenSession"]  # lost
            client.verify(client.open(prompts[1]).session_id, [])  # opened by its first verify
            wait_for(lambda: not client._in_flight, 10, "the resent close to end")
            held = sum(r.open_sessions() for r in fleet.replicas.replicas.values())
            assert held == 1  # the second session only
            closes = [r for r in fleet.replicas.relayed if r.method == "CloseSession"]
            assert [(r.ingress, r.replica) for r in closes] == [("B", home)]
            assert client.closes_resent == 1


class _Payload:
    """A value whose unpickling runs code: it writes `marker` (what a pickle in Redis did)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "pwned"))


def test_a_fleet_config_written_into_redis_by_another_hand_is_refused_never_run(
    fresh_redis: RedisServer, tmp_path: Path
) -> None:
    """Anyone who can write the fleet's Redis replaces its `fleet` key (the stable config the
    rollout controller and a restart read back) with a pickle that runs code, or flips a byte
    of the sealed config (another adapter). The ingress refuses both (`SealError`), as does the
    controller's `FleetConfig.unseal`, and promote refuses a config not sealed with the fleet
    key; the code never runs. No module of fedge.edge imports pickle.

    Before, the config was stored pickled and `pickle.loads`-ed by the controller (app.py,
    rollout.py): write access to Redis was code execution on the controller (the payload
    wrote its marker file)."""
    import pickle

    from fedge.edge.fleet.app import FleetConfig
    from fedge.edge.fleet.sealed import SealError, load_key, write_key

    key = load_key(write_key(tmp_path / "fleet.key"))
    config = FleetConfig(tmp_path / "model", fleet_key_file=tmp_path / "fleet.key")
    sealed = config.seal(key)
    assert FleetConfig.unseal(sealed, key) == config  # typed: paths, nested configs come back
    store = RedisState.connect(fresh_redis.url, fresh_redis.password_file)
    state = IngressState(store, Routing("fedge-v1"), sealed, "deploy-1", key=key)
    marker = tmp_path / "marker"
    evil = pickle.dumps(_Payload(marker))
    flipped = sealed.replace(b"model", b"modem")
    other_key = load_key(write_key(tmp_path / "other.key"))

    async def scenario() -> None:
        await state.start()
        assert await state.fleet_config() == sealed
        for forged in (evil, flipped, config.seal(other_key)):
            await store.client.set(store.key("fleet"), forged)  # another hand writes Redis
            with pytest.raises(SealError):
                await state.fleet_config()
            with pytest.raises(SealError):
                FleetConfig.unseal(forged, key)
            with pytest.raises(SealError):
                await state.promote("fedge-v2", forged)
        assert (await state.describe())["stable"] == "fedge-v1"  # no forged promotion took
        await store.close()

    asyncio.run(scenario())
    assert not marker.exists()
    edge = Path(__file__).resolve().parents[2] / "edge"
    users = [p for p in edge.rglob("*.py") if "import pickle" in p.read_text()]
    assert users == []


def test_a_devices_session_keys_die_with_its_sessions_and_stay_under_its_cap(
    fresh_redis: RedisServer,
) -> None:
    """One device with a quota of 4 sessions per replica on 2 replicas opens 12 sessions one
    after another (the replicas evict its oldest to honour the quota): the fleet's Redis keeps
    at most 8 of its session keys (its least recently called go), each expiring the verifier's
    idle timeout after its last call, renewed by each call; a close or a NOT_FOUND deletes the
    key at once, and once the device is idle for the timeout nothing of it is left.

    Before, every session's key lived 24 h after it last moved whatever happened to the
    session: such a device left 11 keys (measured in issue 31) and grew the store at its
    prefill rate."""
    ttl_s = 4.0  # the renewal is compared on TTLs, not on sleeps racing it (a loaded CI run)
    store = RedisState.connect(
        fresh_redis.url, fresh_redis.password_file, session_ttl_s=ttl_s, max_sessions_per_owner=8
    )
    state = IngressState(store, Routing("fedge-v1"), b"", "deploy-1")
    ok = [CallResult("OK", replica=f"r{i % 2}") for i in range(2)]

    async def keys(owner: str = "") -> list[bytes]:
        found = [k async for k in store.client.scan_iter(match=store.key("session", "*"))]
        return [k for k in found if not owner or store._owner_digest(owner).encode() in k]

    async def scenario() -> None:
        await state.start()
        for i in range(12):
            await state.remember("Verify", f"s{i}", "fedge-v1", ok[i % 2], "device-a")
        await state.remember("Verify", "b0", "fedge-v1", ok[0], "device-b")
        assert len(await keys("device-a")) == 8
        assert await state.target("s0", "device-a") == ("fedge-v1", "")  # dropped: oldest
        assert await state.target("s11", "device-a") == ("fedge-v1", "r1")
        ttl_ms = await store.client.pttl(store._session_key("device-a", "s11"))
        assert 0 < ttl_ms <= ttl_s * 1000
        await state.remember("CloseSession", "s11", "fedge-v1", ok[1], "device-a", "r1")
        await state.remember("Verify", "s10", "fedge-v1", CallResult("NOT_FOUND"), "device-a")
        assert len(await keys("device-a")) == 6
        assert len(await keys("device-b")) == 1  # another device's keys are its own
        await asyncio.sleep(1.0)
        aged = [await store.client.pttl(k) for k in await keys("device-a")]
        await state.target("s4", "device-a")  # a call renews its key to the full timeout
        renewed = await store.client.pttl(store._session_key("device-a", "s4"))
        assert renewed > max(aged), (renewed, aged)  # the others count down from their last call
        await asyncio.sleep(ttl_s + 0.5)
        assert await keys() == []
        owners = [k async for k in store.client.scan_iter(match=store.key("owner", "*"))]
        assert owners == []
        await store.close()

    asyncio.run(scenario())


def test_the_cap_evicts_by_call_order_even_within_one_millisecond(
    fresh_redis: RedisServer,
) -> None:
    """An owner's 8-session cap keeps exactly the 8 sessions called last, whatever their ids,
    when dozens of calls land within the same milliseconds: ids counting down (each newer id
    sorts first) and random ids, 5 rounds.

    Before, scores were whole milliseconds and the sorted set broke ties by id: calls in the
    same millisecond were ranked by name, so a device's newest sessions were evicted before
    older ones (the fleet test above failed on a fast machine: s11, called last, evicted)."""
    import random

    cap, calls = 8, 40
    store = RedisState.connect(
        fresh_redis.url, fresh_redis.password_file, session_ttl_s=60.0, max_sessions_per_owner=cap
    )
    rng = random.Random(7)

    async def kept(owner: str, ids: list[str]) -> list[str]:
        homes = await store.client.mget([store._session_key(owner, i) for i in ids])
        return [i for i, home in zip(ids, homes, strict=True) if home is not None]

    async def scenario() -> None:
        for round_ in range(5):
            owner = f"device-{round_}"
            countdown = [f"s{n:03d}" for n in range(calls, 0, -1)]
            random_ids = [f"{rng.getrandbits(64):016x}" for _ in range(calls)]
            for ids in (countdown, random_ids):
                for session in ids:
                    await store.remember(owner, session, "fedge-v1", "r0")
                assert await kept(owner, ids) == ids[-cap:], (round_, ids[-cap:])
        await store.close()

    asyncio.run(scenario())


def test_a_replica_believes_only_the_identity_the_ingress_signed(
    micro_zoo: ZooPaths, tmp_path: Path
) -> None:
    """Device A decodes through the ingress (credentials, fleet key) to real replicas. A process
    that reaches a replica's relay without the ingress (as a token-less process that joined
    Ray's open control plane did) calls it naming `device-a`: unsigned, with A's signature of
    another call replayed (another session, another method), or signed with another key. Every
    call is refused UNAUTHENTICATED and A's session is neither read nor advanced; A's own calls,
    signed by the ingress, go on.

    Before, the relay trusted the plain `fedge-identity` name: the joined process read and
    advanced A's session (issue 31, finding 6)."""
    from fedge.edge.fleet.relay import IDENTITY_SIG_KEY, sign_identity
    from fedge.edge.fleet.sealed import load_key, write_key
    from fedge.edge.proto import verifier_pb2 as pb
    from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
    from fedge.edge.verifier.auth import IDENTITY_KEY
    from tests.edge.harness import write_credentials

    key_file = write_key(tmp_path / "fleet.key")
    key = load_key(key_file)
    credentials, tokens = write_credentials(tmp_path, ["device-a"])
    spec = IngressSpec("fedge-v1", credentials_file=credentials, fleet_key_file=key_file)
    auth = (("authorization", f"Bearer {tokens['device-a']}"),)
    with contextlib.ExitStack() as stack:
        replicas = stack.enter_context(LocalReplicas(micro_zoo.target_dir, 1, key_file))
        front, _ = stack.enter_context(running_ingress(spec, replicas.handle("ingress")))
        stub = pb_grpc.VerifierStub(
            stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{front.port()}"))
        )
        opened = stub.Verify(
            pb.VerifyRequest(session_id="a1", committed_ids=[3, 4, 5], draft_ids=[6]),
            metadata=auth,
        )
        length = opened.session_length
        (replica,) = replicas.replicas.values()
        loop = replicas._loops["replica-0"]

        def direct(method: str, request: Any, signature: str | None) -> CallResult:
            metadata = [(IDENTITY_KEY, "device-a")]
            if signature is not None:
                metadata.append((IDENTITY_SIG_KEY, signature))
            call = replica.unary(method, request.SerializeToString(), tuple(metadata), 10.0)
            return asyncio.run_coroutine_threadsafe(call, loop).result()

        advance = pb.VerifyRequest(session_id="a1", draft_ids=[7], expected_length=length)
        other_key = load_key(write_key(tmp_path / "other.key"))
        forged = {
            "unsigned": None,
            "another session": sign_identity(key, "device-a", "Verify", "a2"),
            "another method": sign_identity(key, "device-a", "CloseSession", "a1"),
            "another key": sign_identity(other_key, "device-a", "Verify", "a1"),
            "stale": sign_identity(key, "device-a", "Verify", "a1", now=time.time() - 3600),
        }
        for what, signature in forged.items():
            result = direct("Verify", advance, signature)
            assert result.code == "UNAUTHENTICATED", (what, result)
        closed = direct("CloseSession", pb.CloseSessionRequest(session_id="a1"), None)
        assert closed.code == "UNAUTHENTICATED"
        again = stub.Verify(advance, metadata=auth)  # A's session is where A left it
        assert again.session_length == length + again.accepted + 1  # not advanced meanwhile


def test_one_credential_can_neither_pick_its_canary_arm_nor_outweigh_other_owners(
    fresh_redis: RedisServer,
) -> None:
    """A canary takes half of new sessions. Mallory (one credential) opens 40 sessions naming
    the canary's version: the ingress keeps her on the arm it assigned her (by a hash of her
    identity and the canary), every time; 200 owners split about evenly. Then she drives 30
    sessions of perfect acceptance through the canary beside 5 honest owners at 0.2 each: the
    canary's acceptance counts each owner once, (1.0 + 5 x 0.2) / 6 = 0.333 over 6 observations.

    Before, a device picked its arm (`VerifyRequest.version` naming the canary's version put
    every one of her sessions on the canary), and every session weighed one: 31 / 35 = 0.886,
    which promoted a canary the other owners found poor."""
    store = RedisState.connect(fresh_redis.url, fresh_redis.password_file)
    state = IngressState(store, Routing("fedge-v1"), b"", "deploy-1")
    canary_version = "m1/a2"

    async def scenario() -> None:
        await state.start()
        await store.learn_version(canary_version, "fedge-v2")
        await state.set_canary("fedge-v2", 0.5)
        owners = [f"device-{i}" for i in range(200)]
        arms = [(await state.target(f"new-{o}", o))[0] for o in owners]
        assert 70 <= arms.count("fedge-v2") <= 130
        stable_owner = owners[arms.index("fedge-v1")]
        canary_owner = owners[arms.index("fedge-v2")]
        for i in range(40):
            picked = await state.target(f"m{i}", stable_owner, canary_version)
            assert picked == ("fedge-v1", "")
            assert await state.target(f"n{i}", canary_owner) == ("fedge-v2", "")
        for i in range(30):
            outcome = CallOutcome("Verify", "OK", 0.01, 10, 10, f"s{i}", owner=canary_owner)
            await state.observe("fedge-v2", outcome)
        for i in range(5):
            outcome = CallOutcome("Verify", "OK", 0.01, 10, 2, f"h{i}", owner=f"honest-{i}")
            await state.observe("fedge-v2", outcome)
        figures = (await state.arm_stats())["fedge-v2"]
        assert figures["sessions"] == 6
        assert figures["session_acceptance"] == pytest.approx((1.0 + 5 * 0.2) / 6)
        await store.close()

    asyncio.run(scenario())
