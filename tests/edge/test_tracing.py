"""OpenTelemetry spans of one edge request across a real loopback gRPC call, and the exporters."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from transformers import PreTrainedModel

from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient
from fedge.edge.decoder import DecodeConfig
from fedge.edge.proto import verifier_pb2 as pb
from fedge.edge.proto import verifier_pb2_grpc as pb_grpc
from fedge.edge.proto.timing import server_seconds
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.tracing import (
    BATCH_SPAN,
    FORWARD_SPAN,
    REQUEST_SPAN,
    VERIFY_SPAN,
    Tracing,
    TracingConfig,
    shutdown,
    traced_channel,
    tracer_provider,
)
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import BackgroundServer, ServerConfig
from fedge.zoo import ZooPaths

VERIFY_RPC = "/fedge.edge.v1.Verifier/Verify"
GENERATE_RPC = "/fedge.edge.v1.Verifier/Generate"


def recording() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A provider that hands every ended span to an in-memory exporter at once."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def wait_for(
    spans: Callable[[], list[ReadableSpan]], done: Callable[[list[ReadableSpan]], bool]
) -> list[ReadableSpan]:
    """Wait until `done(spans())`: a server span ends just after the client has its reply.

    Fails after 10 s, naming what was missing.
    """
    deadline = time.monotonic() + 10.0
    while not done(current := spans()):
        if time.monotonic() > deadline:
            pytest.fail(f"spans still incomplete after 10 s: {sorted(s.name for s in current)}")
        time.sleep(0.01)
    return current


@pytest.fixture(scope="module")
def traced_server(
    micro_zoo: ZooPaths, micro_target: PreTrainedModel
) -> Iterator[tuple[int, InMemorySpanExporter]]:
    """A verifier whose spans go to their own exporter: only gRPC metadata links it to the client."""
    provider, exporter = recording()
    config = ServerConfig(
        micro_zoo.target_dir,
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=8, batch_window_s=0.001),
    )
    server = BackgroundServer(config, micro_target, tracer_provider=provider)
    server.start()
    yield server.port, exporter
    server.stop(grace_s=0.2)


def test_one_request_is_one_trace_from_the_edge_to_the_forward_pass(
    traced_server: tuple[int, InMemorySpanExporter],
    micro_draft: PreTrainedModel,
    micro_prompts: list[list[int]],
) -> None:
    port, server_spans = traced_server
    server_spans.clear()
    provider, client_spans = recording()
    client = VerifierClient(ClientConfig(f"127.0.0.1:{port}"), tracer_provider=provider)
    edge = EdgeClient(TorchDraftRuntime(micro_draft), None, client, DecodeConfig(max_new_tokens=12))
    tokens = [t for chunk in edge.stream_ids(micro_prompts[7], route="speculative") for t in chunk]
    client.close_channel()

    edge_side = client_spans.get_finished_spans()
    (request,) = [s for s in edge_side if s.name == REQUEST_SPAN]
    assert request.parent is None
    assert request.attributes is not None and request.attributes["fedge.tokens"] == len(tokens)
    verifies = [s for s in edge_side if s.name == VERIFY_SPAN]
    assert len(verifies) == edge.last.rounds > 0  # type: ignore[union-attr]
    assert {v.parent.span_id for v in verifies if v.parent} == {request.context.span_id}
    rpc = {s.context.span_id: s for s in edge_side if s.kind == SpanKind.CLIENT}
    verify_rpcs = [s for s in rpc.values() if s.name == VERIFY_RPC]
    assert sorted(s.parent.span_id for s in verify_rpcs if s.parent) == sorted(
        v.context.span_id for v in verifies
    )
    assert {s.context.trace_id for s in edge_side} == {request.context.trace_id}
    assert not [s for s in edge_side if "Health" in s.name]  # the RTT probe is not traced

    def complete(spans: list[ReadableSpan]) -> bool:  # every server span the asserts read, ended
        server = [s.name for s in spans if s.kind == SpanKind.SERVER]
        return (
            server.count(VERIFY_RPC) >= len(verify_rpcs)
            and len([s for s in spans if s.name == FORWARD_SPAN]) >= len(verify_rpcs)
            and {"/fedge.edge.v1.Verifier/OpenSession", "/fedge.edge.v1.Verifier/CloseSession"}
            <= set(server)
        )

    cloud_side = wait_for(lambda: list(server_spans.get_finished_spans()), complete)
    served = [s for s in cloud_side if s.kind == SpanKind.SERVER and s.name == VERIFY_RPC]
    assert len(served) == len(verify_rpcs)
    for span in served:  # each server span's remote parent is one client Verify span
        assert span.parent is not None and span.parent.is_remote
        assert span.context.trace_id == request.context.trace_id
        assert rpc[span.parent.span_id].name == VERIFY_RPC
        (batch,) = [s for s in cloud_side if s.parent and s.parent.span_id == span.context.span_id]
        assert batch.name == BATCH_SPAN and batch.attributes["fedge.batch.size"] >= 1  # type: ignore[index]
        (forward,) = [
            s for s in cloud_side if s.parent and s.parent.span_id == batch.context.span_id
        ]
        assert forward.name == FORWARD_SPAN
        assert batch.start_time <= forward.start_time <= forward.end_time <= batch.end_time  # type: ignore[operator]
        assert span.start_time <= batch.start_time and batch.end_time <= span.end_time  # type: ignore[operator]
    assert {s.name for s in cloud_side if s.kind == SpanKind.SERVER} >= {
        "/fedge.edge.v1.Verifier/OpenSession",
        "/fedge.edge.v1.Verifier/CloseSession",
    }


def test_without_metadata_the_server_starts_its_own_trace(
    traced_server: tuple[int, InMemorySpanExporter], micro_prompts: list[list[int]]
) -> None:
    """Break propagation on purpose: an untraced client, then a garbled traceparent."""
    port, server_spans = traced_server
    server_spans.clear()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.VerifierStub(channel)
    opened = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=micro_prompts[3]), timeout=10)
    stub.Verify(
        pb.VerifyRequest(session_id=opened.session_id, draft_ids=[]),
        metadata=(("traceparent", "00-not-a-trace-01"),),
        timeout=10,
    )
    channel.close()
    spans = wait_for(
        lambda: list(server_spans.get_finished_spans()),
        lambda spans: (
            len([s for s in spans if s.kind == SpanKind.SERVER]) >= 2
            and any(s.name == FORWARD_SPAN for s in spans)
        ),
    )
    served = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(served) == 2 and all(s.parent is None for s in served)
    assert len({s.context.trace_id for s in served}) == 2


def test_tracing_off_installs_nothing_and_passes_items_through() -> None:
    off = Tracing(None)
    items = iter([1, 2, 3])
    assert list(off.iterate("x", items)) == [1, 2, 3]
    with off.span("x") as span:
        assert span is None
    assert off.capture() is None
    off.record_batch([None], 1, (0, 0, 0, 0), [0])  # a no-op, not an error
    assert tracer_provider(TracingConfig("none")) is None


def test_a_failing_request_span_records_the_error() -> None:
    provider, exporter = recording()

    def broken() -> Iterator[int]:
        yield 1
        raise RuntimeError("verifier vanished")

    with pytest.raises(RuntimeError):
        list(Tracing(provider).iterate(REQUEST_SPAN, broken()))
    (span,) = exporter.get_finished_spans()
    assert not span.status.is_ok and "verifier vanished" in (span.status.description or "")


def test_unknown_exporter_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"TracingConfig.exporter .* got 'jaeger'"):
        TracingConfig("jaeger")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver: keeps the names of the spans it is sent."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.names += [span.name for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_exporter_delivers_spans_to_a_collector() -> None:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        provider = tracer_provider(
            TracingConfig("otlp", "fedge-test", endpoint=f"http://127.0.0.1:{port}")
        )
        with Tracing(provider).span(REQUEST_SPAN):
            pass
        shutdown(provider)  # flushes the batch processor
        assert collector.names == [REQUEST_SPAN]
    finally:
        server.stop(0)


def test_a_traced_generate_keeps_the_verifier_time_in_its_initial_metadata(
    traced_server: tuple[int, InMemorySpanExporter], micro_prompts: list[list[int]]
) -> None:
    """Traced at both ends, a Generate's stream still carries the verifier's `fedge-server-ms` in
    its initial metadata. Before the fix the client's instrumentation returned a bare generator
    (no `initial_metadata`), so a traced edge could not read it and counted the prefill as
    network; the server's interceptor passes it (its context proxies `send_initial_metadata`)."""
    port, server_spans = traced_server
    provider, client_spans = recording()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.VerifierStub(traced_channel(channel, provider))
        # Execute: a batched Generate through the traced channel
        stream = stub.Generate(
            pb.GenerateRequest(prompt_ids=micro_prompts[0], max_new_tokens=5, batch_tokens=True)
        )
        tokens = [t for reply in stream for t in [reply.token_id, *reply.more_token_ids]]
        server_s = server_seconds(stream.initial_metadata())
    finally:
        channel.close()
    # Verify: every token, the verifier's time readable, both ends traced in one trace
    assert len(tokens) == 5
    assert server_s is not None and server_s > 0
    (client,) = [s for s in client_spans.get_finished_spans() if s.name == GENERATE_RPC]
    served = wait_for(
        server_spans.get_finished_spans,
        lambda spans: any(s.context.trace_id == client.context.trace_id for s in spans),
    )
    assert [s.name for s in served if s.context.trace_id == client.context.trace_id] == [
        GENERATE_RPC
    ]
