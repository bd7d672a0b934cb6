"""Userspace network emulator: an asyncio TCP proxy that delays, throttles, stalls and cuts a link.

`tc netem` does not exist on these machines' kernel, so tests and benches put this proxy between
real endpoints on 127.0.0.1 (edge client -> proxy -> verifier). Each direction is a link of its
own: bytes leave `rtt/2` (plus optional jitter) after they were read, never overtaking earlier
bytes of the same connection, and at most `bandwidth` bytes per second per direction (shared by
all connections, as one access link is). On command the proxy can

- ``stall(s)``: hold every byte for `s` seconds, then deliver it in order (a link outage that TCP
  rides out by retransmitting);
- ``reset()``: abort every connection with a TCP RST (a NAT rebinding, a middlebox restart);
- ``blackhole(s)``: drop every byte and leave new connections unanswered for `s` seconds, then
  reset every connection that lived through it (a partition long enough that TCP state is lost).

It can also stand for a load balancer: ``spread(ports)`` sends new connections round robin over
several endpoints, as a Kubernetes Service spreads them over its pods (a connection stays on its
endpoint for life; one that cannot reach its endpoint is reset), and ``cut(port)`` kills one
endpoint as a pod's death does: its connections and every new one sent to it are reset.

Run it in a background thread (``NetworkEmulator(...).start() -> port``, ``stop()``) or as
``python -m fedge.simulations.netem --listen 127.0.0.1:7000 --target 127.0.0.1:50051 --rtt-ms 100``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from fedge.simulations.network_profiles import PROFILES, NetworkProfile, profile

__all__ = ["PROFILES", "LinkConfig", "NetworkEmulator", "NetworkProfile", "profile"]

_T = TypeVar("_T")
CHUNK = 64 * 1024  # bytes read per socket read: one HTTP/2 frame burst
QUEUE_CHUNKS = 64  # chunks buffered per direction and connection before reading pauses (4 MiB)


@dataclass(frozen=True)
class LinkConfig:
    """What the emulated link does to each direction (seconds, bytes per second)."""

    rtt_s: float = 0.0
    jitter_s: float = 0.0  # uniform in [-jitter, +jitter] per chunk, clipped so delay stays >= 0
    bandwidth_bps: float | None = None  # bytes per second per direction; None = unlimited

    def __post_init__(self) -> None:
        for field in ("rtt_s", "jitter_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"LinkConfig.{field} must be >= 0, got {getattr(self, field)}")
        if self.bandwidth_bps is not None and self.bandwidth_bps <= 0:
            raise ValueError(
                f"LinkConfig.bandwidth_bps must be > 0 or None, got {self.bandwidth_bps}"
            )

    @classmethod
    def from_profile(cls, p: NetworkProfile) -> LinkConfig:
        """The link of a named profile."""
        bandwidth = None if p.bandwidth_mbit is None else p.bandwidth_mbit * 1e6 / 8
        return cls(p.rtt_ms / 1e3, p.jitter_ms / 1e3, bandwidth)


@dataclass
class _Direction:
    """One direction of the link: when it is free again (bandwidth) and what it carried."""

    free_at: float = 0.0
    bytes: int = 0


class _Connection:
    """A proxied TCP connection: client side, target side, and the pumps between them."""

    def __init__(
        self, client: asyncio.StreamWriter, target: asyncio.StreamWriter, endpoint: tuple[str, int]
    ) -> None:
        self.client = client
        self.target = target
        self.endpoint = endpoint  # (host, port) the connection was sent to
        self.tasks: list[asyncio.Task[None]] = []
        self.lost = False  # lived through a blackhole: reset when it ends

    def abort(self) -> None:
        """Close both sides with RST (SO_LINGER 0) and stop the pumps."""
        for writer in (self.client, self.target):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class NetworkEmulator:
    """A TCP proxy on 127.0.0.1 towards (target_host, target_port) with an emulated link."""

    def __init__(
        self,
        target_port: int,
        link: LinkConfig | None = None,
        *,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int = 0,
    ) -> None:
        self.targets = [(target_host, target_port)]  # new connections go round robin over these
        self._turn = 0
        self._dead: set[int] = set()  # ports of endpoints cut: new connections to them are reset
        self.listen = (listen_host, listen_port)
        self.link = link or LinkConfig()
        self.rng = random.Random(seed)
        self.up = _Direction()  # client -> target
        self.down = _Direction()  # target -> client
        self.connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # one per accepted connection
        self.accepted = 0
        self._flowing: asyncio.Event | None = None  # cleared while stalled or blackholed
        self._blackholed = False
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> int:
        """Start the proxy in a daemon thread; returns the port it listens on."""
        if self._thread is not None:
            raise RuntimeError("NetworkEmulator.start: already started")
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._open())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="netem", daemon=True)
        self._thread.start()
        if not ready.wait(10.0):
            raise RuntimeError("NetworkEmulator.start: proxy did not start within 10 s")
        return self.port

    def stop(self) -> None:
        """Close the listener and every connection, then end the thread."""
        if self._loop is None or self._thread is None:
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> NetworkEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def serve_forever(self) -> None:
        """Run in the caller's event loop until cancelled (the CLI's mode)."""
        await self._open()
        try:
            await asyncio.Event().wait()
        finally:
            await self._close()

    # ---- commands (thread-safe) ----------------------------------------------------------------
    def set_link(self, link: LinkConfig) -> None:
        """Change RTT, jitter or bandwidth from now on (bytes already queued keep their times)."""
        self.link = link

    def stall(self, seconds: float) -> None:
        """Hold every byte for `seconds`, then deliver it in order; connections survive."""
        self._call(self._outage(seconds, drop=False))

    def blackhole(self, seconds: float) -> None:
        """Drop everything for `seconds` (new connections hang), then reset what lived through it."""
        self._call(self._outage(seconds, drop=True))

    @property
    def target(self) -> tuple[str, int]:
        """The endpoint the next connection goes to."""
        return self.targets[self._turn % len(self.targets)]

    def retarget(self, port: int, host: str = "127.0.0.1") -> None:
        """Send new connections to another endpoint (a restarted server, as a load balancer would)."""
        self.spread([port], host)

    def spread(self, ports: Sequence[int], host: str = "127.0.0.1") -> None:
        """Send new connections round robin over these endpoints (a Service over its pods)."""
        if not ports:
            raise ValueError("NetworkEmulator.spread needs at least one port")
        self.targets = [(host, port) for port in ports]

    def reset(self) -> int:
        """Abort every open connection with a RST; returns how many there were."""
        return self._call(self._reset_all())

    def cut(self, port: int) -> int:
        """The endpoint on `port` dies, as a pod does: its connections are reset (RST), and so is
        every new one sent to it while it stays listed (`spread` drops it); returns how many
        connections it had."""
        return self._call(self._cut(port))

    @property
    def bytes_up(self) -> int:
        """Bytes forwarded client -> target so far."""
        return self.up.bytes

    @property
    def bytes_down(self) -> int:
        """Bytes forwarded target -> client so far."""
        return self.down.bytes

    # ---- internals --------------------------------------------------------------------------
    def _call(self, coro: Awaitable[_T]) -> _T:
        """Run a coroutine on the proxy's loop from another thread and wait for it."""
        if self._loop is None:
            raise RuntimeError("NetworkEmulator: not started (call start() first)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10.0)  # type: ignore[arg-type]

    async def _open(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, *self.listen)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()
        handlers = [task for task in self._handlers if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _cut(self, port: int) -> int:
        self._dead.add(port)
        return await self._reset_all(port)

    async def _reset_all(self, port: int | None = None) -> int:
        doomed = [c for c in self.connections if port is None or c.endpoint[1] == port]
        for conn in doomed:
            conn.abort()
            self.connections.discard(conn)
        return len(doomed)

    async def _outage(self, seconds: float, drop: bool) -> None:
        """Start an outage now and end it `seconds` later, without blocking the caller."""
        assert self._flowing is not None
        self._flowing.clear()
        self._blackholed = self._blackholed or drop
        if drop:
            for conn in self.connections:
                conn.lost = True
        asyncio.get_running_loop().call_later(seconds, self._end_outage)

    def _end_outage(self) -> None:
        assert self._flowing is not None
        if self._blackholed:
            for conn in [c for c in self.connections if c.lost]:
                conn.abort()
                self.connections.discard(conn)
        self._blackholed = False
        self._flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one accepted connection; a shutdown ends it quietly."""
        self.accepted += 1
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        try:
            await self._proxy(reader, writer)
        except asyncio.CancelledError:  # stopping: Python 3.11's server callback would log it
            writer.transport.abort()

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Connect to the target (after any blackhole) and pump both directions."""
        assert self._flowing is not None
        if self._blackholed:  # SYN dropped: the client's connect hangs, then gets reset
            await self._flowing.wait()
            writer.transport.abort()
            return
        endpoint = self.target
        self._turn += 1
        try:
            if endpoint[1] in self._dead:
                raise ConnectionRefusedError(f"endpoint {endpoint} was cut")
            t_reader, t_writer = await asyncio.open_connection(*endpoint)
        except OSError:
            writer.transport.abort()  # target down: the client sees a reset, as from a real host
            return
        conn = _Connection(writer, t_writer, endpoint)
        if endpoint[1] in self._dead:  # cut while this connection was being made
            conn.abort()
            return
        self.connections.add(conn)
        pumps = [
            asyncio.create_task(self._pump(reader, t_writer, self.up, conn)),
            asyncio.create_task(self._pump(t_reader, writer, self.down, conn)),
        ]
        conn.tasks.extend(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self.connections.discard(conn)
        for side in (writer, t_writer):
            side.close()

    def _delay(self) -> float:
        """One-way delay of the next chunk: RTT/2 plus uniform jitter, never negative."""
        link = self.link
        jitter = self.rng.uniform(-link.jitter_s, link.jitter_s) if link.jitter_s else 0.0
        return max(0.0, link.rtt_s / 2 + jitter)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: _Direction,
        conn: _Connection,
    ) -> None:
        """Read from one side and schedule each chunk for the other side at its arrival time."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        sender = asyncio.create_task(self._deliver(queue, writer, direction, conn))
        conn.tasks.append(sender)
        last_due = 0.0
        try:
            while data := await reader.read(CHUNK):
                if self._blackholed:
                    continue  # dropped on the floor
                now = time.monotonic()
                if self.link.bandwidth_bps:  # serialise onto the shared link
                    direction.free_at = (
                        max(now, direction.free_at) + len(data) / self.link.bandwidth_bps
                    )
                    sent = direction.free_at
                else:
                    sent = now
                last_due = max(last_due, sent + self._delay())  # never overtake earlier bytes
                await queue.put((last_due, data))
        except (ConnectionError, OSError):
            pass
        await queue.put((last_due, b""))  # end of stream: half-close after the last byte
        await sender

    async def _deliver(
        self,
        queue: asyncio.Queue[tuple[float, bytes]],
        writer: asyncio.StreamWriter,
        direction: _Direction,
        conn: _Connection,
    ) -> None:
        """Write each chunk when it is due and the link flows; EOF closes the write side."""
        assert self._flowing is not None
        try:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()  # a blackhole ends by resetting `conn`: never past here
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                direction.bytes += len(data)
                await writer.drain()
        except (ConnectionError, OSError):
            conn.abort()
            self.connections.discard(conn)


def _hostport(text: str) -> tuple[str, int]:
    """Parse host:port, naming the bad value."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> None:
    """Run the proxy in the foreground until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m fedge.simulations.netem", description=__doc__)
    parser.add_argument("--listen", type=_hostport, default=("127.0.0.1", 0), help="host:port")
    parser.add_argument("--target", type=_hostport, required=True, help="host:port to forward to")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), help="a named link (overridden by flags)"
    )
    parser.add_argument("--rtt-ms", type=float, help="round-trip time added (ms)")
    parser.add_argument("--jitter-ms", type=float, help="uniform jitter per direction (ms)")
    parser.add_argument("--bandwidth-mbit", type=float, help="cap per direction (Mbit/s)")
    args = parser.parse_args(argv)
    link = LinkConfig.from_profile(profile(args.profile)) if args.profile else LinkConfig()
    if args.rtt_ms is not None:
        link = replace(link, rtt_s=args.rtt_ms / 1e3)
    if args.jitter_ms is not None:
        link = replace(link, jitter_s=args.jitter_ms / 1e3)
    if args.bandwidth_mbit is not None:
        link = replace(link, bandwidth_bps=args.bandwidth_mbit * 1e6 / 8)
    emulator = NetworkEmulator(
        args.target[1],
        link,
        target_host=args.target[0],
        listen_host=args.listen[0],
        listen_port=args.listen[1],
    )

    async def run() -> None:
        opened = asyncio.create_task(emulator.serve_forever())
        while not emulator.port and not opened.done():
            await asyncio.sleep(0.01)
        print(
            f"netem listening on {args.listen[0]}:{emulator.port} -> {args.target[0]}:{args.target[1]} {link}",
            flush=True,
        )
        await opened

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
