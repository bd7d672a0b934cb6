"""Prometheus metrics of the verifier: requests, latency, batch sizes, acceptance, sessions."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Watched(Protocol):
    """What the metrics read from a live engine."""

    @property
    def running(self) -> bool: ...

    @property
    def queue_depth(self) -> int: ...


LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


class VerifierMetrics:
    """Owns one registry (so several servers in a process never collide) and the engine hooks."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "fedge_verifier_requests",
            "RPCs handled, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "fedge_verifier_latency_seconds",
            "RPC handling time, by method",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "fedge_verifier_batch_size",
            "Verifies per target forward pass",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "fedge_verifier_batch_seconds",
            "Time of one batched verification pass",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.accepted = Histogram(
            "fedge_verifier_accepted_tokens",
            "Draft tokens accepted per verify",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.drafted = Counter(
            "fedge_verifier_drafted_tokens", "Draft tokens received", registry=self.registry
        )
        self.sessions = Gauge("fedge_verifier_sessions", "Open sessions", registry=self.registry)
        self.kv_bytes = Gauge(
            "fedge_verifier_kv_bytes", "KV cache bytes held by sessions", registry=self.registry
        )
        self.evictions = Counter(
            "fedge_verifier_evictions",
            "Sessions dropped, by reason (ttl, lru)",
            ["reason"],
            registry=self.registry,
        )

        self.abandoned = Counter(
            "fedge_verifier_abandoned",
            "Queued requests skipped because their caller was gone (cancelled, deadline), by kind",
            ["kind"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "fedge_verifier_queue_depth", "Requests waiting for the engine", registry=self.registry
        )
        self.worker_alive = Gauge(
            "fedge_verifier_worker_alive",
            "1 while the engine's worker thread runs, 0 before it starts or after it died",
            registry=self.registry,
        )

    def watch(self, engine: Watched) -> None:
        """Read queue depth and worker liveness from `engine` at every scrape."""
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.worker_alive.set_function(lambda: 1.0 if engine.running else 0.0)

    # EngineObserver hooks
    def on_batch(self, size: int, seconds: float) -> None:
        """Record one batched pass."""
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def on_verify(self, drafted: int, accepted: int) -> None:
        """Record one session's verdict."""
        self.drafted.inc(drafted)
        self.accepted.observe(accepted)

    def on_sessions(self, count: int, kv_bytes: int) -> None:
        """Record the session store's size."""
        self.sessions.set(count)
        self.kv_bytes.set(kv_bytes)

    def on_evict(self, reason: str) -> None:
        """Record one eviction."""
        self.evictions.labels(reason=reason).inc()

    def on_abandoned(self, kind: str) -> None:
        """Record one queued request dropped because its caller had gone."""
        self.abandoned.labels(kind=kind).inc()
