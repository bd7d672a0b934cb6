"""The edge's round-trip estimate is the network's, not the verifier's compute: real verifier on
127.0.0.1, a prompt whose prefill is far longer than the (simulated) link's round trip."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.proto.timing import SERVER_MS_KEY, server_seconds
from fedge.edge.verifier.engine import EngineConfig, Sampling
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths
from tests.edge.conftest import tiny_llama
from tests.edge.harness import LocalReplicas, running_ingress

LINK_RTT_S = 0.01  # the client's added round trip: the "network"
PROMPT_TOKENS = 1500  # a prefill of ~0.1 s on this target on a quiet core: ~10x the link


@pytest.fixture(scope="module")
def slow_prefill() -> PreTrainedModel:
    """A target (micro tokenizer's vocabulary) whose long-prompt prefill takes ~0.1 s."""
    return tiny_llama(1024, 4, 128, seed=0, context=2048)


@pytest.fixture(scope="module")
def server(micro_zoo: ZooPaths, slow_prefill: PreTrainedModel) -> Iterator[BackgroundServer]:
    """A verifier serving the slow-prefill target."""
    config = ServerConfig(
        micro_zoo.target_dir,
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=8, batch_window_s=0.002),
    )
    with BackgroundServer(config, slow_prefill) as background:
        yield background


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[VerifierClient]:
    """A client over the simulated link, connected (a fresh channel's first call pays the
    connection), with no exchange recorded yet."""
    config = ClientConfig(f"127.0.0.1:{server.port}", added_rtt_s=LINK_RTT_S)
    with VerifierClient(config) as verifier:
        verifier.ping()
        verifier.forget_round_trips()
        yield verifier


@pytest.fixture
def traced_client(
    server: BackgroundServer,
) -> Iterator[tuple[VerifierClient, InMemorySpanExporter]]:
    """The same client on a traced channel (client spans, `traceparent` injected), and its spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = ClientConfig(f"127.0.0.1:{server.port}", added_rtt_s=LINK_RTT_S)
    with VerifierClient(config, provider) as verifier:
        verifier.ping()
        verifier.forget_round_trips()
        yield verifier, exporter
    provider.shutdown()


def long_prompt() -> list[int]:
    """PROMPT_TOKENS ids of the micro vocabulary (ids 0 and 1 are BOS / EOS)."""
    return torch.randint(
        2, 1024, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)
    ).tolist()


def test_open_session_prefill_is_not_network(client: VerifierClient) -> None:
    """Before the fix the RTT after an OpenSession was the whole exchange, the prompt's prefill
    included (>= the prefill, ~10x the link here): the router then charged every speculative
    verify a prefill and kept a good draft off the speculative route. Now the verifier reports
    its time (`fedge-server-ms`) and the RTT is the link's: under half the call, never below it."""
    # Execute: one OpenSession with a long prompt, timed here as the caller sees it
    started = time.perf_counter()
    info = client.open_remote(long_prompt(), client_sampling())
    opened_s = time.perf_counter() - started  # the added link RTT (slept) + network + prefill
    rtt = client.recent_round_trip(60.0)
    # Verify: the estimate kept the link and dropped (most of) the verifier's prefill
    assert rtt is not None
    assert LINK_RTT_S <= rtt < LINK_RTT_S + (opened_s - LINK_RTT_S) / 2, (rtt, opened_s)
    # a Verify on the session is timed net of the verifier's pass as well
    client.verify(info.session_id, [5, 6, 7])
    after = client.recent_round_trip(60.0)
    assert after is not None and LINK_RTT_S <= after <= LINK_RTT_S + (opened_s - LINK_RTT_S) / 2
    client.close_remote(info.session_id)


def test_generate_first_reply_prefill_is_not_network(client: VerifierClient) -> None:
    """Before the fix a cloud-only request's first reply (prefill plus a first pass) was the
    shortest recent exchange: at a 100 ms link the router believed 0.33 s (SmolLM2, docs/edge.md).
    Now the stream's initial metadata carries the verifier's time to that reply."""
    # Execute: a Generate with a long prompt; the first chunk's arrival timed here
    rtt, first_s = long_generate_rtt(client)
    # Verify: the RTT is the link's, under half the time to the first reply
    assert LINK_RTT_S <= rtt < LINK_RTT_S + (first_s - LINK_RTT_S) / 2, (rtt, first_s)


def long_generate_rtt(client: VerifierClient) -> tuple[float, float]:
    """A 4-token Generate of `long_prompt()`: the client's recent RTT after it, and the seconds
    to its first reply as timed here (all 4 tokens must come)."""
    started = time.perf_counter()
    stream = client.generate_chunks(long_prompt(), max_new_tokens=4)
    first = next(stream)
    first_s = time.perf_counter() - started
    rest = [token for chunk in stream for token in chunk]
    rtt = client.recent_round_trip(60.0)
    assert len(first) + len(rest) == 4
    assert rtt is not None
    return rtt, first_s


def test_traced_generate_first_reply_prefill_is_not_network(
    traced_client: tuple[VerifierClient, InMemorySpanExporter],
) -> None:
    """Before the fix a traced edge's Generate went through the instrumentation's bare reply
    generator, which hid the call's initial `fedge-server-ms`: the RTT recorded was the whole wait
    for the first reply, the 1,500-token prefill included (0.147 s of 0.148 s, on a 10 ms link). Now the traced
    stream keeps the call's metadata: the RTT is the link's, and the Generate still has its client span."""
    client, spans = traced_client
    # Execute: a traced Generate with a long prompt; the first chunk's arrival timed here
    rtt, first_s = long_generate_rtt(client)
    # Verify: the RTT left the prefill out, and the call was traced
    assert LINK_RTT_S <= rtt < LINK_RTT_S + (first_s - LINK_RTT_S) / 2, (rtt, first_s)
    assert [s.name for s in spans.get_finished_spans()] == ["/fedge.edge.v1.Verifier/Generate"]


def client_sampling() -> Sampling:
    """Greedy sampling."""
    return Sampling()


def test_the_fleet_ingress_reports_its_time_too(
    micro_zoo: ZooPaths, micro_prompts: list[list[int]]
) -> None:
    """Before, the ingress relayed a replica's reply without the verifier's metadata, so behind a
    fleet every exchange (prefills included) counted as network. Now it reports its own time,
    from the call's arrival to its reply (relay and replica included): a unary call's in its
    trailing metadata, a Generate's in the initial metadata of its first reply, each no longer
    than the exchange the caller timed."""
    prompt = micro_prompts[8]  # 60 tokens
    with (
        LocalReplicas(micro_zoo.target_dir, 1) as replicas,
        running_ingress(IngressSpec("fedge-v1"), replicas.handle("ingress")) as (front, _),
        grpc.insecure_channel(f"127.0.0.1:{front.port()}") as channel,
    ):
        stub = pb_grpc.VerifierStub(channel)
        # Execute: an OpenSession and a Generate through the ingress, each timed here
        started = time.perf_counter()
        opened, call = stub.OpenSession.with_call(pb.OpenSessionRequest(prompt_ids=prompt))
        open_s = time.perf_counter() - started
        started = time.perf_counter()
        stream = stub.Generate(pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=3))
        next(stream)
        first_s = time.perf_counter() - started
        list(stream)
        # Verify: both carry the fleet's time, within what the caller waited
        open_server_s = server_seconds(call.trailing_metadata())
        first_server_s = server_seconds(stream.initial_metadata())
        assert opened.session_id
        assert open_server_s is not None and 0 < open_server_s <= open_s
        assert first_server_s is not None and 0 < first_server_s <= first_s


@pytest.mark.parametrize(
    ("metadata", "seconds"),
    [
        (((SERVER_MS_KEY, "250.5"),), 0.2505),
        (((SERVER_MS_KEY, b"12"),), 0.012),
        ((("other", "5"),), None),
        (((SERVER_MS_KEY, "-3"),), None),
        (((SERVER_MS_KEY, "nan"),), None),
        (((SERVER_MS_KEY, "soon"),), None),
        (None, None),
    ],
)
def test_server_time_parsing(
    metadata: tuple[tuple[str, object], ...] | None, seconds: float | None
) -> None:
    """A verifier that sends no key, or a value that is no time, leaves the exchange counted whole."""
    assert server_seconds(metadata) == (pytest.approx(seconds) if seconds is not None else None)
