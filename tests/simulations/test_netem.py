"""The userspace network emulator between a real gRPC client and a real gRPC server on loopback."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from fedge.simulations.netem import PROFILES, LinkConfig, NetworkEmulator, NetworkProfile, profile

ECHO = "/netem.Test/Echo"
SLOW = "/netem.Test/Slow"  # replies after the number of milliseconds given as the request's text


SLOW_ENTERED = threading.Event()  # set when the server has the slow request in hand


def _slow(request: bytes, context: grpc.ServicerContext) -> bytes:
    SLOW_ENTERED.set()
    time.sleep(int(request.decode()) / 1e3)
    return b"done"


@pytest.fixture(scope="module")
def grpc_port() -> Iterator[int]:
    """A real gRPC server on 127.0.0.1 with a raw-bytes echo and a slow method."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Slow": grpc.unary_unary_rpc_method_handler(_slow),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("netem.Test", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def _call(channel: grpc.Channel, method: str, payload: bytes, timeout: float = 5.0) -> bytes:
    """One raw-bytes unary call."""
    stub = channel.unary_unary(method)
    return stub(payload, timeout=timeout)  # type: ignore[no-any-return]


def _wait_transport_dropped(channel: grpc.Channel, timeout_s: float = 5.0) -> None:
    """Wait until the channel itself has seen its connection go (it leaves READY): a call made
    before that can still be written to the dead socket and fail with it."""
    dropped = threading.Event()

    def on_state(state: grpc.ChannelConnectivity) -> None:
        if state is not grpc.ChannelConnectivity.READY:
            dropped.set()

    channel.subscribe(on_state, try_to_connect=False)
    try:
        assert dropped.wait(timeout_s), (
            "the channel still reports READY after its connection was reset"
        )
    finally:
        channel.unsubscribe(on_state)


def _call_time(channel: grpc.Channel, payload: bytes = b"x") -> float:
    started = time.perf_counter()
    _call(channel, ECHO, payload)
    return time.perf_counter() - started


def _poll(channel: grpc.Channel, deadline_s: float) -> None:
    """Call until one succeeds, failing the test past the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            _call(channel, ECHO, b"ping", timeout=1.0)
            return
        except grpc.RpcError:
            if time.monotonic() > end:
                raise


def test_unary_rtt_matches_configured(grpc_port: int) -> None:
    """The extra latency of a unary call through the proxy is the configured RTT (one round trip)."""
    rtt = 0.08
    with (
        NetworkEmulator(grpc_port, LinkConfig(rtt_s=rtt)) as netem,
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as direct,
        grpc.insecure_channel(f"127.0.0.1:{netem.port}") as proxied,
    ):
        _call(direct, ECHO, b"warm")
        _call(proxied, ECHO, b"warm")  # connection set up outside the measurement
        base = statistics.median(_call_time(direct) for _ in range(5))
        through = statistics.median(_call_time(proxied) for _ in range(5))
    added = through - base
    assert added >= 0.95 * rtt  # a request and its reply each wait rtt/2: never faster
    assert added <= rtt + 0.25  # and not several round trips (generous for a loaded machine)


def test_reset_fails_inflight_then_next_call_succeeds(grpc_port: int) -> None:
    """reset() ends an in-flight call with UNAVAILABLE; the channel reconnects for the next one."""
    with (
        NetworkEmulator(grpc_port) as netem,
        grpc.insecure_channel(f"127.0.0.1:{netem.port}") as channel,
    ):
        _call(channel, ECHO, b"warm")
        errors: list[grpc.RpcError] = []

        def slow() -> None:
            try:
                _call(channel, SLOW, b"3000")
            except grpc.RpcError as err:
                errors.append(err)

        SLOW_ENTERED.clear()
        thread = threading.Thread(target=slow)
        thread.start()
        assert SLOW_ENTERED.wait(5)  # the call is in flight: the server is working on it
        started = time.monotonic()
        assert netem.reset() == 1
        thread.join(5)
        assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE]
        assert time.monotonic() - started < 2.0  # failed on the reset, not after the slow reply
        _wait_transport_dropped(channel)
        assert _call(channel, ECHO, b"again") == b"again"


def _was_reset(sock: socket.socket) -> bool:
    """Whether the proxy closed `sock` (RST or EOF) rather than leaving it open."""
    sock.settimeout(5.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_spread_takes_turns_and_cut_kills_one_endpoint() -> None:
    """Four connections through a proxy spread over two endpoints land on them in turn. Cut, the
    first endpoint's two connections are reset, and so is a new one sent to it (its turn), while
    the other endpoint's connections carry bytes on; once dropped from the spread, new connections
    reach the live endpoint only."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    ports = [listener.getsockname()[1] for listener in listeners]
    for listener in listeners:
        listener.settimeout(5.0)
    with NetworkEmulator(ports[0]) as proxy:
        proxy.spread(ports)
        clients = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(4)]
        accepted = [listeners[i % 2].accept()[0] for i in range(4)]  # times out when out of turn
        deadline = time.monotonic() + 5.0
        while len(proxy.connections) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the proxy registers each connection once its own connect returns
        assert proxy.cut(ports[0]) == 2
        assert _was_reset(clients[0]) and _was_reset(clients[2])
        assert _was_reset(
            socket.create_connection(("127.0.0.1", proxy.port))
        )  # the dead one's turn
        clients[1].sendall(b"y")
        assert accepted[1].recv(1) == b"y"
        proxy.spread(ports[1:])
        late = socket.create_connection(("127.0.0.1", proxy.port))
        late.sendall(b"z")
        assert listeners[1].accept()[0].recv(1) == b"z"
    for sock in [*clients, *accepted, *listeners, late]:
        sock.close()


def test_blackhole_then_recovery(grpc_port: int) -> None:
    """During a blackhole calls time out; after it, the channel reconnects and calls succeed."""
    with (
        NetworkEmulator(grpc_port) as netem,
        grpc.insecure_channel(f"127.0.0.1:{netem.port}") as channel,
    ):
        _call(channel, ECHO, b"warm")
        netem.blackhole(0.6)
        with pytest.raises(grpc.RpcError) as info:
            _call(channel, ECHO, b"lost", timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _poll(channel, 10.0)
        assert _call(channel, ECHO, b"back") == b"back"


def test_stall_delays_but_delivers(grpc_port: int) -> None:
    """A stall holds the call for its duration, then the reply arrives on the same connection."""
    with (
        NetworkEmulator(grpc_port) as netem,
        grpc.insecure_channel(f"127.0.0.1:{netem.port}") as channel,
    ):
        _call(channel, ECHO, b"warm")
        accepted = netem.accepted
        netem.stall(0.4)
        assert _call_time(channel) >= 0.38
        assert netem.accepted == accepted  # no reconnect was needed


def test_bandwidth_cap_is_measurable(grpc_port: int) -> None:
    """A 60 kB echo over a 300 kB/s link takes at least 2 x 60/300 s; uncapped it takes far less."""
    payload = b"z" * 60_000
    bandwidth = 300_000.0
    with (
        NetworkEmulator(grpc_port, LinkConfig(bandwidth_bps=bandwidth)) as netem,
        grpc.insecure_channel(f"127.0.0.1:{netem.port}") as channel,
    ):
        _call(channel, ECHO, b"warm")
        spent = _call_time(channel, payload)
        netem.set_link(LinkConfig())
        uncapped = _call_time(channel, payload)
    assert spent >= 0.9 * 2 * len(payload) / bandwidth  # up, then down, each serialised
    assert uncapped < spent / 2


def test_jitter_preserves_byte_order() -> None:
    """With jitter larger than the gap between writes, bytes still arrive in the order sent."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def echo() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                received.extend(data)

    thread = threading.Thread(target=echo)
    thread.start()
    link = LinkConfig(rtt_s=0.02, jitter_s=0.02)
    with NetworkEmulator(listener.getsockname()[1], link, seed=3) as netem:
        sent = bytearray()
        with socket.create_connection(("127.0.0.1", netem.port)) as client:
            for i in range(100):
                chunk = f"{i:04d}".encode()
                client.sendall(chunk)
                sent.extend(chunk)
                time.sleep(0.001)
        thread.join(10)
    listener.close()
    assert bytes(received) == bytes(sent)


def test_profiles_and_bad_input() -> None:
    """Named profiles convert to links; bad values name the field; unknown names list the options."""
    link = LinkConfig.from_profile(PROFILES["wan-100"])
    assert link.rtt_s == pytest.approx(0.1)
    assert link.bandwidth_bps == pytest.approx(50e6 / 8)
    with pytest.raises(ValueError, match=r"known: .*lan"):
        profile("dialup")
    with pytest.raises(ValueError, match=r"LinkConfig\.rtt_s"):
        LinkConfig(rtt_s=-1)
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        NetworkProfile("x", 1.0, bandwidth_mbit=0)
