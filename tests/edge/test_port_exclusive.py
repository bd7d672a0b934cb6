"""A verifier's or a fleet ingress's port is its own: binding a port another process listens on
fails loudly instead of sharing it.

gRPC servers set SO_REUSEPORT by default, so on Linux a second server of the same user binds a
port already in use and the kernel splits new connections between the two. A fresh-clone CI
run showed the damage: the fleet test's port, probed free and then taken by another test's
verifier before the ingress bound it, was shared, and one of eight edge sessions was decoded
by the other process's model (its 16 tokens all wrong, the other 7 exact).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from transformers import PreTrainedModel

from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.ports import LOWEST, ephemeral_low, free_port
from fedge.zoo import ZooPaths
from tests.edge.harness import running_ingress


@pytest.fixture
def squatter() -> Iterator[int]:
    """Another process's gRPC server with gRPC's default options (SO_REUSEPORT), answering
    health checks NOT_SERVING; yields its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


def test_a_verifier_refuses_a_port_another_server_listens_on(
    squatter: int, micro_zoo: ZooPaths, micro_target: PreTrainedModel
) -> None:
    """Before, the verifier bound the squatter's port as well and answered only part of the
    connections made to it."""
    config = ServerConfig(micro_zoo.target_dir, port=squatter, drain_notice_s=0.0)
    refused = f"127.0.0.1:{squatter} \\(in use\\?\\); pick another port"
    with pytest.raises(OSError, match=refused), BackgroundServer(config, micro_target):
        pass


def test_a_lone_fleet_ingress_refuses_a_port_another_server_listens_on(squatter: int) -> None:
    """Before, the ingress bound it too (SO_REUSEPORT was always on), and an edge session whose
    connection the kernel gave the squatter was decoded there."""
    refused = f"fleet ingress to 127.0.0.1:{squatter} \\(in use\\?\\)"
    with pytest.raises(OSError, match=refused), running_ingress(IngressSpec("v1", port=squatter)):
        pass


def test_ingress_replicas_meant_to_share_a_port_do_share_it() -> None:
    """Several ingress replicas on one node listen on one port together (`share_port`)."""
    spec = IngressSpec("v1", port=free_port("127.0.0.1"), share_port=True)
    with running_ingress(spec) as (first, _), running_ingress(spec) as (second, _):
        assert first.port() == second.port() == spec.port
        with grpc.insecure_channel(f"127.0.0.1:{spec.port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_fixed_port_is_never_one_the_kernel_hands_out_for_port_0() -> None:
    """`free_port` picks below the ephemeral range, where another server binding port 0 cannot
    land between the probe and the fleet's bind."""
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= p < ephemeral_low() for p in ports), ports
