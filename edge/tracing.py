"""OpenTelemetry tracing of edge requests and verifier work, propagated over gRPC metadata.

One request's trace, edge to cloud:

    edge.request                     EdgeClient, one per request (route, tokens, acceptance)
      edge.verify                    VerifierClient, one per verify round trip (retries inside)
        /fedge.edge.v1.Verifier/Verify          gRPC client span (opentelemetry-instrumentation-grpc),
          /fedge.edge.v1.Verifier/Verify        which injects W3C `traceparent` metadata; gRPC server span
            verifier.batch           the batched pass that served this verify (size, queue wait)
              verifier.forward       the target forward pass inside it

A batch serves many requests from many traces, so the engine records its batch and
forward spans under each member request's server span, with the batch's own start
and end times and a shared `fedge.batch.id`. Tracing is off unless a component is
given a tracer provider: off, no interceptor is installed and no span is created,
so the cost is one `is None` test per call. `tracer_provider(config)` builds one
exporting to OTLP (gRPC), the console, or nowhere (`none`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer, TracerProvider

T = TypeVar("T")

EXPORTERS = ("none", "console", "otlp")
TRACING_ENV = "FEDGE_TRACING"  # none | console | otlp; the CLI's --tracing default
SERVICE_NAME_ATTRIBUTE = "service.name"
INSTRUMENTATION = "fedge.edge"
BATCH_SPAN, FORWARD_SPAN = "verifier.batch", "verifier.forward"
REQUEST_SPAN, VERIFY_SPAN = "edge.request", "edge.verify"


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go; `otlp` reads OTEL_EXPORTER_OTLP_ENDPOINT etc. unless `endpoint` is given."""

    exporter: str = "none"  # none | console | otlp
    service_name: str = "fedge"  # the resource's service.name (e.g. fedge-verifier, fedge-edge)
    endpoint: str | None = None  # OTLP gRPC collector, e.g. http://otel-collector:4317

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(
                f"TracingConfig.exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}"
            )

    @classmethod
    def from_env(cls, service_name: str) -> TracingConfig:
        """The exporter named by $FEDGE_TRACING (default none)."""
        return cls(os.environ.get(TRACING_ENV, "none").strip().lower() or "none", service_name)


def tracer_provider(config: TracingConfig) -> TracerProvider | None:
    """An SDK provider that batches spans to the configured exporter; None when tracing is off."""
    if config.exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    exporter: SpanExporter
    if config.exporter == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.endpoint)
    provider = SdkTracerProvider(
        resource=Resource.create({SERVICE_NAME_ATTRIBUTE: config.service_name})
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def shutdown(provider: TracerProvider | None) -> None:
    """Flush and stop a provider built by `tracer_provider` (no-op for None)."""
    stop = getattr(provider, "shutdown", None)
    if stop is not None:
        stop()


def _not_health(details: Any) -> bool:
    """Leave health checks (probes, pings) out of traces."""
    method = getattr(details, "method", None) or getattr(details, "full_method", "")
    if isinstance(method, bytes):
        method = method.decode()
    return not str(method).startswith("/grpc.health.v1.Health/")


def server_interceptors(provider: TracerProvider | None) -> list[grpc.aio.ServerInterceptor]:
    """The gRPC server span interceptor (reads `traceparent` metadata), or none when off."""
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=provider, filter_=_not_health)]


def traced_channel(channel: grpc.Channel, provider: TracerProvider | None) -> grpc.Channel:
    """The channel with a client span interceptor that injects `traceparent`, or as is when off.

    A response stream keeps its call's metadata (`_KeepStreamCall`): the instrumentation alone
    hands back a bare generator, which hid a Generate's initial `fedge-server-ms`, so a traced
    edge counted the prompt's prefill as network in its round-trip estimate.
    """
    if provider is None:
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor, grpcext

    interceptor = client_interceptor(tracer_provider=provider, filter_=_not_health)
    keeping = _keep_stream_call_class()
    return grpcext.intercept_channel(channel, keeping(interceptor))  # type: ignore[no-any-return]


@functools.cache
def _keep_stream_call_class() -> type:
    """`_KeepStreamCall` as grpcext's client interceptor classes, built once (grpcext comes with
    the optional instrumentation, so it is imported only when tracing is on)."""
    from opentelemetry.instrumentation.grpc import grpcext

    return type(
        "KeepStreamCallInterceptor",
        (_KeepStreamCall, grpcext.UnaryClientInterceptor, grpcext.StreamClientInterceptor),
        {},
    )


class _KeepStreamCall:
    """Wraps the instrumentation's client interceptor (as its grpcext interceptor classes, mixed
    in by `traced_channel`); a server-streaming call's result is a `_TracedStream`: the
    instrumentation's generator (the span around the replies) that also answers the call's own
    methods (`initial_metadata()`, `trailing_metadata()`, `code()`...)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def intercept_unary(self, request: Any, metadata: Any, client_info: Any, invoker: Any) -> Any:
        return self._inner.intercept_unary(request, metadata, client_info, invoker)

    def intercept_stream(
        self, request_or_iterator: Any, metadata: Any, client_info: Any, invoker: Any
    ) -> Any:
        if client_info.is_client_stream or not client_info.is_server_stream:
            return self._inner.intercept_stream(request_or_iterator, metadata, client_info, invoker)
        calls: list[Any] = []

        def keeping(request: Any, call_metadata: Any) -> Any:
            call = invoker(request, call_metadata)
            calls.append(call)
            return call

        replies = self._inner.intercept_stream(request_or_iterator, metadata, client_info, keeping)
        return _TracedStream(replies, calls)


class _TracedStream:
    """The replies of a traced response stream, with the call's methods once it has started
    (the instrumentation starts the call at the first `next`; before it, metadata is None)."""

    def __init__(self, replies: Iterator[Any], calls: list[Any]) -> None:
        self._replies = replies
        self._calls = calls

    def __iter__(self) -> _TracedStream:
        return self

    def __next__(self) -> Any:
        return next(self._replies)

    def initial_metadata(self) -> Any:
        return self._calls[0].initial_metadata() if self._calls else None

    def trailing_metadata(self) -> Any:
        return self._calls[0].trailing_metadata() if self._calls else None

    def cancel(self) -> bool:
        if self._calls:
            return bool(self._calls[0].cancel())
        close = getattr(self._replies, "close", None)
        if close is not None:
            close()
        return False

    def __getattr__(self, name: str) -> Any:
        if not self._calls:
            raise AttributeError(f"{name}: the traced call has not started (iterate it first)")
        return getattr(self._calls[0], name)


class Tracing:
    """A component's tracer, or nothing: every method is a no-op when the provider is None."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider
        self.tracer: Tracer | None = (
            None if provider is None else provider.get_tracer(INSTRUMENTATION)
        )

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span | None]:
        """A current span named `name` for the block (None when off)."""
        if self.tracer is None:
            yield None
            return
        with self.tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def iterate(
        self,
        name: str,
        items: Iterator[T],
        finish: Callable[[Span], None] | None = None,
        **attributes: Any,
    ) -> Iterator[T]:
        """Yield from `items` inside a span that is current only while `items` runs.

        A generator that held its span current across `yield` would leak it into the
        consumer's code between items; this attaches the context around each step only.
        `finish(span)` may add attributes before the span ends.
        """
        if self.tracer is None:
            yield from items
            return
        span = self.tracer.start_span(name, attributes=attributes)
        current = trace.set_span_in_context(span)
        try:
            while True:
                token = otel_context.attach(current)
                try:
                    item = next(items)
                except StopIteration:
                    return
                finally:
                    otel_context.detach(token)
                yield item
        except Exception as error:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            raise
        finally:
            if finish is not None:
                finish(span)
            span.end()

    def capture(self) -> otel_context.Context | None:
        """The caller's context, to parent work done later on another thread (None when off)."""
        return None if self.tracer is None else otel_context.get_current()

    def record_batch(
        self,
        parents: Sequence[otel_context.Context | None],
        batch_id: int,
        times_ns: tuple[int, int, int, int],
        queued_ns: Sequence[int],
    ) -> None:
        """Record one batched pass under each member request: batch (start..end) > forward.

        `times_ns` are wall-clock ns of batch start, forward start, forward end and batch end
        (taken before any verdict is delivered, so a batch span ends inside its server span);
        `queued_ns[i]` is when request i was queued.
        """
        if self.tracer is None:
            return
        started, forward_started, forward_ended, ended = times_ns
        for parent, queued in zip(parents, queued_ns, strict=True):
            if parent is None:
                continue
            batch = self.tracer.start_span(
                BATCH_SPAN,
                context=parent,
                start_time=started,
                attributes={
                    "fedge.batch.id": batch_id,
                    "fedge.batch.size": len(parents),
                    "fedge.queue_wait_ms": max(0, started - queued) / 1e6,
                },
            )
            forward = self.tracer.start_span(
                FORWARD_SPAN,
                context=trace.set_span_in_context(batch),
                start_time=forward_started,
            )
            forward.end(end_time=forward_ended)
            batch.end(end_time=ended)


NO_TRACING = Tracing(None)
