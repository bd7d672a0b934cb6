"""Authentication and session ownership through the real fleet: a second ingress, with per-device
credentials and TLS, in front of the package's Serve fleet (its replicas, real gRPC, real Ray)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from transformers import PreTrainedModel

from edge.fleet.app import ingress_application
from edge.fleet.ingress_spec import IngressSpec
from edge.proto import verifier_pb2 as pb
from edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.models import load_causal_lm
from fedge.zoo import ZooPaths
from tests.edge.harness import write_credentials
from tests.edge.test_service import self_signed_cert

AUTH_INGRESS = "fedge-ingress-auth"


@pytest.fixture(scope="module")
def secure_front(
    fleet: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[pb_grpc.VerifierStub, dict[str, tuple[tuple[str, str], ...]]]]:
    """An ingress with alice's and mallory's credentials over TLS, relaying to the fleet's replicas."""
    from ray import serve

    directory = tmp_path_factory.mktemp("secure-front")
    cert, key = self_signed_cert(directory)
    credentials, tokens = write_credentials(directory, ["alice", "mallory"])
    spec = IngressSpec(
        fleet.describe()["stable"], credentials_file=credentials, tls_cert=cert, tls_key=key
    )
    handle = serve.run(ingress_application(spec), name=AUTH_INGRESS, route_prefix=None)
    port = int(handle.port.remote().result())
    channel = grpc.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(cert.read_bytes()),
        options=[("grpc.ssl_target_name_override", "localhost")],
    )
    auth = {d: (("authorization", f"Bearer {t}"),) for d, t in tokens.items()}
    yield pb_grpc.VerifierStub(channel), auth
    channel.close()
    serve.delete(AUTH_INGRESS)


def test_through_the_fleet_a_device_owns_its_sessions_and_strangers_get_nothing(
    secure_front: tuple[pb_grpc.VerifierStub, dict[str, tuple[tuple[str, str], ...]]],
    micro_zoo: ZooPaths,
) -> None:
    """Over TLS through a real fleet: a token-less call is UNAUTHENTICATED at the ingress; mallory,
    with valid credentials, names alice's session and gets NOT_FOUND for reading, advancing and
    closing it (the replica scopes it by the identity the ingress relayed, not by any token);
    alice's session then continues exactly where it was, on its replica, without a reopen.

    On main the fleet took one shared token for every device and the ingress authenticated
    nobody: any caller reached the replicas, and any holder of the token could read, advance
    and close another device's session by its id."""
    stub, auth = secure_front
    target: PreTrainedModel = load_causal_lm(micro_zoo.target_dir)
    prompt = [5, 17, 42, 9, 33, 8, 21]
    out = target.generate(  # type: ignore[operator]
        torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
    )[0, len(prompt) :].tolist()
    with pytest.raises(grpc.RpcError) as stranger:
        stub.Verify(pb.VerifyRequest(session_id="x", committed_ids=prompt), timeout=30)
    assert stranger.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    opened = stub.Verify(
        pb.VerifyRequest(
            session_id="alice-fleet",
            committed_ids=prompt,
            draft_ids=out[:2],
            expected_length=len(prompt),
        ),
        metadata=auth["alice"],
        timeout=60,
    )
    assert (opened.accepted, opened.next_token) == (2, out[2])
    length = opened.session_length
    for request in (
        pb.VerifyRequest(session_id="alice-fleet", draft_ids=[]),
        pb.VerifyRequest(session_id="alice-fleet", draft_ids=[3], expected_length=length),
    ):
        with pytest.raises(grpc.RpcError) as read:
            stub.Verify(request, metadata=auth["mallory"], timeout=60)
        assert read.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    close = pb.CloseSessionRequest(session_id="alice-fleet")
    with pytest.raises(grpc.RpcError) as closed:
        stub.CloseSession(close, metadata=auth["mallory"], timeout=60)
    assert closed.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    follow = pb.VerifyRequest(session_id="alice-fleet", draft_ids=out[3:5], expected_length=length)
    reply = stub.Verify(follow, metadata=auth["alice"], timeout=60)  # no committed_ids: no reopen
    assert (reply.accepted, reply.next_token) == (2, out[5])
    assert stub.CloseSession(close, metadata=auth["alice"], timeout=60).session_length == length + 3
