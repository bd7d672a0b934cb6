"""Test helpers: per-device credentials, client certificates signed by a test CA, a fleet
ingress and its verifier replicas running outside Ray Serve."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from google.protobuf import message_factory

from fedge.edge.fleet.ingress import FleetIngress, IngressSpec
from fedge.edge.fleet.relay import session_of
from fedge.edge.fleet.replica import ReplicaSpec, VerifierReplica
from fedge.edge.fleet.routers import ROUTE_REPLICA, ROUTE_SESSION
from fedge.edge.fleet.wire import ROUTE_PIN, CallResult, Metadata
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.verifier.limits import DEVICE_KEY

T = TypeVar("T")


def write_credentials(directory: Path, devices: list[str]) -> tuple[Path, dict[str, str]]:
    """A credentials file giving each device a fresh random token; returns it and device -> token."""
    tokens = {device: secrets.token_hex(16) for device in devices}
    path = directory / "credentials"
    path.write_text("# identity token\n" + "".join(f"{d} {t}\n" for d, t in tokens.items()))
    return path, tokens


def client_certificate(
    ca_cert: Path, ca_key: Path, name: str, directory: Path
) -> tuple[Path, Path]:
    """A real client certificate for common name `name`, signed by the CA's key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    issuer = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())  # type: ignore[arg-type]
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class LocalIngress(FleetIngress):
    """The ingress outside Serve: its teardown is awaited by `running_ingress`, not the collector."""

    loop: asyncio.AbstractEventLoop

    def __del__(self) -> None:
        return None

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run one of the ingress's coroutines on its loop (its store's client lives there)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)


class NoReplicas:
    """Stands where Ray Serve's deployment handle is: records each relay, then fails it.

    It observes what the ingress would ship to a replica (no replica is needed to show
    that a refused call ships nothing) and raises what the handle would on a fault that
    takes a cluster to cause (`fail`); with `gate`, a relay first waits for it to open.
    """

    def __init__(self) -> None:
        self.relayed: list[dict[str, str]] = []
        self.fail: Callable[[], BaseException] = lambda: RuntimeError("no replica in this test")
        self.gate: threading.Event | None = None

    @property
    def unary(self) -> NoReplicas:
        return self

    def options(self, **_: Any) -> NoReplicas:
        return self

    async def remote(self, method: str, payload: bytes, metadata: Any, *_: Any, **__: Any) -> Any:
        self.relayed.append(dict(metadata))
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.01)
        raise self.fail()


class Relay(NamedTuple):
    """One call an ingress relayed: which ingress, method, device, session, the home replica the
    ingress named ("" when it knew none), the replica that got the call and the session key the
    routers count sessions by."""

    ingress: str
    method: str
    device: str
    session: str
    home: str
    replica: str
    key: str


class LocalReplicas:
    """Real verifier replicas outside Ray; `handle(name)` stands where an ingress's deployment
    handle is.

    Each replica is a `VerifierReplica` (its model, private verifier and relay), its
    relays run on an event loop of its own, as each Serve replica is an actor with its
    own loop. A call goes where the fleet's routers send it with session affinity: a
    pinned call to its replica (to any when that one is gone: it refuses), a session's
    call to its home, any other round robin. Every relay is recorded in `relayed`.
    """

    def __init__(self, model_dir: Path, count: int, fleet_key_file: Path | None = None) -> None:
        self.relayed: list[Relay] = []
        self.replicas: dict[str, VerifierReplica] = {}
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._turn = itertools.count()
        for index in range(count):
            name = f"replica-{index}"
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True).start()
            self._loops[name] = loop
            spec = ReplicaSpec(model_dir, fleet_key_file=fleet_key_file)
            self.replicas[name] = VerifierReplica(spec, name, index)

    def handle(self, ingress: str) -> ReplicaHandle:
        """The deployment handle of the ingress named `ingress` (its relays are recorded so)."""
        return ReplicaHandle(self, ingress)

    def pick(self, hints: dict[str, object]) -> str:
        """The replica a call goes to: pinned, else its session's home, else the next in turn."""
        for wanted in (hints.get(ROUTE_PIN), hints.get(ROUTE_REPLICA)):
            if wanted in self.replicas:
                return str(wanted)
        names = sorted(self.replicas)
        return names[next(self._turn) % len(names)]

    def _route(
        self, ingress: str, method: str, payload: bytes, metadata: Metadata, hints: dict[str, Any]
    ) -> str:
        """The replica a relayed call goes to; the call is recorded."""
        name = self.pick(hints)
        request_cls = message_factory.GetMessageClass(
            pb.DESCRIPTOR.services_by_name["Verifier"].methods_by_name[method].input_type
        )
        device = dict(metadata).get(DEVICE_KEY, "")
        session = session_of(request_cls.FromString(payload))
        home = str(hints.get(ROUTE_REPLICA) or "")
        key = str(hints.get(ROUTE_SESSION) or "")
        self.relayed.append(Relay(ingress, method, device, session, home, name, key))
        return name

    async def unary(
        self,
        ingress: str,
        method: str,
        payload: bytes,
        metadata: Metadata,
        *args: Any,
        **hints: Any,
    ) -> CallResult:
        """Relay one unary call on the chosen replica's loop; record it."""
        name = self._route(ingress, method, payload, metadata, hints)
        call = self.replicas[name].unary(method, payload, metadata, *args, **hints)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self._loops[name]))

    async def stream(
        self,
        ingress: str,
        method: str,
        payload: bytes,
        metadata: Metadata,
        *args: Any,
        **hints: Any,
    ) -> AsyncIterator[CallResult]:
        """Relay one streaming call from the chosen replica's loop, message by message; record it."""
        name = self._route(ingress, method, payload, metadata, hints)
        caller = asyncio.get_running_loop()
        messages: asyncio.Queue[CallResult | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                replica = self.replicas[name]
                async for result in replica.stream(method, payload, metadata, *args, **hints):
                    caller.call_soon_threadsafe(messages.put_nowait, result)
            finally:
                caller.call_soon_threadsafe(messages.put_nowait, None)

        pumping = asyncio.run_coroutine_threadsafe(pump(), self._loops[name])
        try:
            while (result := await messages.get()) is not None:
                yield result
        finally:
            pumping.cancel()

    def close(self) -> None:
        """Stop every replica's verifier, as Serve does when it stops a replica, and its loop."""
        for name, replica in self.replicas.items():
            replica.__del__()
            self._loops[name].call_soon_threadsafe(self._loops[name].stop)

    def __enter__(self) -> LocalReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Gate(threading.Event):
    """An event a test sets from its thread; while it is set, coroutines that pass through it
    wait (`waiting` counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0

    async def pass_through(self) -> None:
        """Return once the gate is clear (at once when it is)."""
        self.waiting += 1
        try:
            while self.is_set():
                await asyncio.sleep(0.005)
        finally:
            self.waiting -= 1


class ReplicaHandle:
    """One ingress's deployment handle over `LocalReplicas`, called as Serve's is.

    While `holding` is set, each answer a replica gave (each streamed message past the
    first `pass_messages` of a stream) waits in the ingress before it is returned (`held`
    counts them): the call has been applied, its reply is not out yet. While `stalling` is
    set, each unary call waits in the ingress before any replica sees it (`stalled`).
    """

    def __init__(self, replicas: LocalReplicas, ingress: str) -> None:
        self.replicas, self.ingress = replicas, ingress
        self.holding = Gate()
        self.stalling = Gate()
        self.pass_messages = 0

    @property
    def unary(self) -> ReplicaHandle:
        return self

    @property
    def stream(self) -> ReplicaStreams:
        return ReplicaStreams(self)

    def options(self, **_: Any) -> ReplicaHandle:
        return self

    @property
    def held(self) -> int:
        """Answers waiting in the ingress while `holding` is set."""
        return self.holding.waiting

    @property
    def stalled(self) -> int:
        """Calls waiting in the ingress, before any replica, while `stalling` is set."""
        return self.stalling.waiting

    async def remote(self, *args: Any, **hints: Any) -> CallResult:
        await self.stalling.pass_through()
        result = await self.replicas.unary(self.ingress, *args, **hints)
        await self.holding.pass_through()
        return result


class ReplicaStreams:
    """`handle.stream`: streaming calls through a `ReplicaHandle`."""

    def __init__(self, handle: ReplicaHandle) -> None:
        self.handle = handle

    async def remote(self, *args: Any, **hints: Any) -> AsyncIterator[CallResult]:
        handle = self.handle
        passed = 0
        async for result in handle.replicas.stream(handle.ingress, *args, **hints):
            if passed >= handle.pass_messages:
                await handle.holding.pass_through()
            passed += 1
            yield result


@contextlib.contextmanager
def running_ingress(
    spec: IngressSpec, handle: Any = None
) -> Iterator[tuple[LocalIngress, NoReplicas]]:
    """A real fleet ingress (its gRPC server, auth, limits) on a loop thread, relaying to nobody
    (`NoReplicas`) or through `handle` (e.g. a `LocalReplicas.handle`)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    front = LocalIngress.__new__(LocalIngress)  # what Serve does: construct, then await __init__
    front.loop = loop
    asyncio.run_coroutine_threadsafe(front.__init__(spec), loop).result()  # type: ignore[func-returns-value]
    replicas = NoReplicas()
    front._handle = lambda app: handle or replicas  # type: ignore[method-assign]
    try:
        yield front, replicas
    finally:
        asyncio.run_coroutine_threadsafe(FleetIngress.__del__(front), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
