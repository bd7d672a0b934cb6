"""Authentication first, over real gRPC and TLS on 127.0.0.1: per-device credentials, mTLS, and a
rate limit that only the authenticated identity can spend, in the single verifier and the fleet ingress."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.verifier.auth import IDENTITY_KEY, Credentials
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.limits import DEVICE_KEY, VERIFY, RateLimitConfig, retry_after_ms
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.simulations.local_services import self_signed_cert
from fedge.zoo import ZooPaths
from tests.edge.harness import (
    LocalIngress,
    NoReplicas,
    client_certificate,
    running_ingress,
    write_credentials,
)
from tests.edge.test_service import code_of, given_up_on, health_status

MAX_DRAFT = 8
LIMITS = RateLimitConfig(verify_rate=1.0, verify_burst=MAX_DRAFT + 1, generate_rate=1.0)
DEVICES = ["alice", "bob", "mallory"]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost, made with `cryptography` (also the test CA)."""
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A credentials file for alice, bob and mallory, each with a random token of their own."""
    return write_credentials(tmp_path_factory.mktemp("creds"), DEVICES)


@pytest.fixture(scope="module")
def server(
    micro_zoo: ZooPaths,
    micro_target: PreTrainedModel,
    tls: tuple[Path, Path],
    credentials: tuple[Path, dict[str, str]],
) -> Iterator[BackgroundServer]:
    """A verifier over TLS that knows three devices; 1 verify token/s per device, burst 9."""
    cert, key = tls
    config = ServerConfig(
        micro_zoo.target_dir,
        credentials_file=credentials[0],
        tls_cert=cert,
        tls_key=key,
        health_port=0,  # plaintext health alone, for probes that cannot speak TLS
        drain_notice_s=0.0,
        rate_limits=LIMITS,
        engine=EngineConfig(max_draft=MAX_DRAFT, batch_window_s=0.001),
    )
    with BackgroundServer(config, micro_target) as background:
        yield background


def secure_stub(port: int, cert: Path) -> pb_grpc.VerifierStub:
    """A raw stub over TLS to 127.0.0.1:`port`, checking the certificate as `localhost`."""
    channel = grpc.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(cert.read_bytes()),
        options=[("grpc.ssl_target_name_override", "localhost")],
    )
    return pb_grpc.VerifierStub(channel)


def full_burst_verify(session_id: str, prompt: list[int]) -> pb.VerifyRequest:
    """A verify costing the whole burst (max_draft + 1 tokens), opening its session."""
    return pb.VerifyRequest(
        session_id=session_id, draft_ids=prompt[:MAX_DRAFT], committed_ids=prompt
    )


def status_of(method: Any, request: Any, metadata: Any) -> grpc.StatusCode:
    """The status a call ends with (a stream is read to its end)."""
    with pytest.raises(grpc.RpcError) as caught:
        reply = method(request, metadata=metadata, timeout=10)
        if not hasattr(reply, "ByteSize"):  # a stream: its status comes at its end
            list(reply)
    return caught.value.code()  # type: ignore[attr-defined,no-any-return]


def strangers(token: str) -> list[tuple[tuple[str, str], ...]]:
    """Call metadata of callers claiming alice's device: no token, a wrong one, a mangled one."""
    claim = (DEVICE_KEY, "alice")
    return [
        (claim,),
        (claim, ("authorization", "Bearer " + "0" * 32)),
        (claim, ("authorization", "Bearer " + token[:-1])),
        (claim, ("authorization", token)),  # no "Bearer " scheme
    ]


# ------------------------------------------------------------------------------ credentials
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alice\n", ":1: expected 'IDENTITY TOKEN', got 1 fields"),
        ("alice short\n", ":1: the token of 'alice' is under 16"),
        ("# devices\nal/ce " + "a" * 32 + "\n", ":2: identity 'al/ce'"),
        (f"alice {'a' * 32}\nbob {'a' * 32}\n", ":2: this token is already given to 'alice'"),
        ("# nobody\n", "holds no credentials"),
    ],
)
def test_a_bad_credentials_file_is_refused_naming_file_and_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "credentials"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Credentials.load(path)
    with pytest.raises(FileNotFoundError, match="IDENTITY TOKEN"):
        Credentials.load(tmp_path / "missing")


def test_credentials_map_each_token_to_its_device_and_keep_no_token(tmp_path: Path) -> None:
    path, tokens = write_credentials(tmp_path, ["alice", "bob"])
    loaded = Credentials.load(path)
    assert [loaded.identify(tokens[d]) for d in ("alice", "bob")] == ["alice", "bob"]
    assert loaded.identify(tokens["alice"][:-1]) is None and loaded.identify("") is None
    assert all(tokens["alice"].encode() not in digest for digest, _ in loaded.entries())


def test_both_verifier_clis_take_credentials_and_tls() -> None:
    from fedge.edge.cli import generate_command, serve_command
    from fedge.edge.fleet.cli import fleet_command

    for command in (serve_command, fleet_command):
        params = inspect.signature(command).parameters
        assert {"credentials", "tls_cert", "tls_key", "tls_client_ca"} <= set(params)
        assert "token" not in params or command is serve_command  # the fleet: per-device only
    edge = inspect.signature(generate_command).parameters
    assert {"credential_file", "tls_ca", "tls_client_cert", "tls_client_key"} <= set(edge)


# ------------------------------------------------------------------------ single verifier
def test_strangers_claiming_a_device_cost_it_nothing(
    server: BackgroundServer,
    tls: tuple[Path, Path],
    credentials: tuple[Path, dict[str, str]],
    micro_prompts: list[list[int]],
) -> None:
    """Token-less, wrong-token and malformed calls naming alice's device leave her bucket full.

    Authentication now runs before the limiter. The damage before the fix was seen where it
    happened, at the fleet ingress (a stranger's call charged to device:alice and relayed,
    `test_ingress_refuses_strangers_before_charging_or_relaying`) and with a credentialed device
    spending another's budget (the next test); for this single-verifier case it was not run."""
    stub = secure_stub(server.port, tls[0])
    prompt = micro_prompts[8]
    generate = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=16)
    for metadata in strangers(credentials[1]["alice"]) * 3:
        verify = full_burst_verify("stolen", prompt)
        assert status_of(stub.Verify, verify, metadata) == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(stub.Generate, generate, metadata) == grpc.StatusCode.UNAUTHENTICATED
    plaintext = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    alice_auth = (("authorization", f"Bearer {credentials[1]['alice']}"),)
    refused = code_of(
        lambda: plaintext.Verify(full_burst_verify("p", prompt), metadata=alice_auth, timeout=5)
    )
    assert refused == grpc.StatusCode.UNAVAILABLE  # no TLS, no talk: no token in clear
    assert server.server is not None and server.server.health_port
    assert health_status(server.server.health_port) == health_pb2.HealthCheckResponse.SERVING
    # alice's whole burst is still hers: one verify of max_draft + 1 tokens passes
    reply = stub.Verify(full_burst_verify("alice-1", prompt), metadata=alice_auth)
    assert reply.session_length > len(prompt)


def test_a_device_with_valid_credentials_cannot_spend_another_devices_budget(
    server: BackgroundServer,
    tls: tuple[Path, Path],
    credentials: tuple[Path, dict[str, str]],
    micro_prompts: list[list[int]],
) -> None:
    """Mallory, holding her own valid token, claims bob's device in `fedge-device` and spends a
    whole burst; bob is then still served and mallory is the one refused.

    On main the rate limit was keyed by the self-asserted header: mallory's verify drained
    bob's bucket and bob's next verify was refused RESOURCE_EXHAUSTED (checked with the
    same calls on main's `ServerConfig(tokens=...)`)."""
    stub = secure_stub(server.port, tls[0])
    prompt = micro_prompts[9]
    mallory = (
        ("authorization", f"Bearer {credentials[1]['mallory']}"),
        (DEVICE_KEY, "bob"),
    )
    stub.Verify(full_burst_verify("mallory-1", prompt), metadata=mallory)
    with VerifierClient(
        ClientConfig(
            f"127.0.0.1:{server.port}",
            token_file=_token_file(credentials[1]["bob"], credentials[0].parent),
            root_cert=tls[0],
            tls_server_name="localhost",
            device_id="bob",
            max_retries=0,
        )
    ) as bob:
        session = bob.open(prompt).session_id  # OpenSession is not a verify: free
        assert bob.verify(session, prompt[:MAX_DRAFT]).session_length > len(prompt)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Verify(full_burst_verify("mallory-2", prompt), metadata=mallory)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert retry_after_ms(refused.value.trailing_metadata()) is not None  # type: ignore[attr-defined]


def _token_file(token: str, directory: Path) -> Path:
    """A device's token in a file of its own (the edge client reads it at start)."""
    path = directory / "device.token"
    path.write_text(token + "\n")
    return path


def test_mtls_names_the_device_by_its_certificate(
    micro_zoo: ZooPaths,
    micro_target: PreTrainedModel,
    tls: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    cert, key = tls
    config = ServerConfig(
        micro_zoo.target_dir,
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=cert,  # the test CA signs the devices' certificates
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=MAX_DRAFT),
    )
    phone_cert, phone_key = client_certificate(cert, key, "phone-7", tmp_path)
    target = "127.0.0.1:{}"
    with BackgroundServer(config, micro_target) as background:
        address = target.format(background.port)
        with VerifierClient(
            ClientConfig(
                address,
                root_cert=cert,
                tls_server_name="localhost",
                client_cert=phone_cert,
                client_key=phone_key,
            )
        ) as phone:
            phone.open([1, 2, 3])
            assert background.server is not None and background.server.engine is not None
            owners = {s.owner for s in background.server.engine.sessions._sessions.values()}
            assert owners == {"cert:phone-7"}
        without = ClientConfig(
            address, root_cert=cert, tls_server_name="localhost", timeout_s=3, unreachable_after_s=0
        )
        with VerifierClient(without) as anonymous:
            assert given_up_on(lambda: anonymous.open([1, 2, 3])) == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------- fleet ingress (no Ray)
@pytest.fixture(scope="module")
def ingress(
    tls: tuple[Path, Path], credentials: tuple[Path, dict[str, str]]
) -> Iterator[tuple[LocalIngress, NoReplicas]]:
    """A real fleet ingress (TLS, credentials, 1 verify token/s per device) on its own loop."""
    cert, key = tls
    spec = IngressSpec(
        "fedge-v1", credentials_file=credentials[0], tls_cert=cert, tls_key=key, rate_limits=LIMITS
    )
    with running_ingress(spec) as running:
        yield running


def test_ingress_refuses_strangers_before_charging_or_relaying(
    ingress: tuple[LocalIngress, NoReplicas],
    tls: tuple[Path, Path],
    credentials: tuple[Path, dict[str, str]],
    micro_prompts: list[list[int]],
) -> None:
    """Token-less and wrong-token calls claiming alice's device are UNAUTHENTICATED at the
    ingress: no bucket is charged and nothing is relayed to a replica.

    On main the ingress had no authentication: the same token-less calls were charged to
    alice's bucket (keyed by the header they asserted) and relayed, 4 MiB at a time, to a
    replica before anyone checked a token (checked on main with the same calls)."""
    front, replicas = ingress
    stub = secure_stub(front.port(), tls[0])
    prompt = micro_prompts[8]
    for metadata in strangers(credentials[1]["alice"]) * 3:
        verify = full_burst_verify("stolen", prompt)
        assert status_of(stub.Verify, verify, metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert front.limits.current is not None
    buckets = front.limits.current._limiter.buckets[VERIFY]._buckets  # type: ignore[attr-defined]
    assert len(buckets) == 0 and replicas.relayed == []
    # a valid device is charged as itself whatever it claims, and its token stays in the ingress
    mallory = (("authorization", f"Bearer {credentials[1]['mallory']}"), (DEVICE_KEY, "alice"))
    assert code_of(lambda: stub.Verify(full_burst_verify("m", prompt), metadata=mallory)) == (
        grpc.StatusCode.UNAVAILABLE  # no replica here
    )
    assert list(buckets._buckets) == ["id:mallory"]
    assert replicas.relayed and all(
        m[IDENTITY_KEY] == "mallory" and "authorization" not in m for m in replicas.relayed
    )
