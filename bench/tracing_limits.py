"""What tracing, rate limits, TLS + auth cost a verify round trip, against the same server without them.

One in-process verifier (micro zoo, loopback gRPC) per configuration, the same
sequential workload on each (a session per round, drafts of 4 tokens), calls
alternating across configurations so machine noise hits them alike:

- baseline: tracing off, no rate limit (the default);
- tracing: server and client traced, spans batched to an in-memory exporter;
- limits: a per-device verify bucket that never refuses (the check's cost only);
- tls+auth: TLS on the listener (a self-signed localhost certificate) and a token per device
  from a credentials file, the client verifying the certificate and sending its token.

Reported: p50/p99 verify round trip per configuration and its ratio to the baseline;
and, since "off" cannot be compared against code without the hooks, the measured cost
of the hooks' off path (the `is None` checks, the no-op context capture and the
pass-through request iterator) per verify, as a fraction of the baseline p50.
Goal for tls+auth: p50 <= 1.1x the baseline. Usage: ``python bench/tracing_limits.py [--rounds 8] [--verifies 40]``. The last line is
one JSON object, also written to ``bench/results/tracing_limits.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
import timeit
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import alternating_args, alternating_verifies, percentiles
from bench._fleet_setup import Secure, secure_material

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "tracing_limits.json"
DRAFT = 4


def in_memory_provider() -> Any:
    """A tracer provider batching spans to memory (export cost without a network)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    return provider


def start(name: str, zoo: Any, model: Any, secure: Secure) -> tuple[Any, Any]:
    """A verifier and its client for one configuration."""
    from fedge.edge.client import ClientConfig, VerifierClient
    from fedge.edge.verifier.engine import EngineConfig
    from fedge.edge.verifier.limits import RateLimitConfig
    from fedge.edge.verifier.server import BackgroundServer, ServerConfig

    limits = RateLimitConfig(verify_rate=1e9, verify_burst=10**9) if name == "limits" else None
    provider = in_memory_provider() if name == "tracing" else None
    tls = name == "tls+auth"
    config = ServerConfig(
        zoo.target_dir,
        drain_notice_s=0.0,
        engine=EngineConfig(max_draft=8, batch_window_s=0.0, torch_threads=1),
        rate_limits=limits or RateLimitConfig(),
        credentials_file=secure.credentials if tls else None,
        tls_cert=secure.cert if tls else None,
        tls_key=secure.key if tls else None,
    )
    server = BackgroundServer(config, model, tracer_provider=provider)
    port = server.start()
    client_config = ClientConfig(
        f"127.0.0.1:{port}",
        device_id="bench",
        token=secure.tokens[0] if tls else None,
        root_cert=secure.cert if tls else None,
    )
    return server, VerifierClient(client_config, tracer_provider=provider)


def off_path_ns() -> float:
    """ns per verify spent in the hooks when tracing and limits are off."""
    from fedge.edge.tracing import NO_TRACING

    items = iter(range(10**7))
    passthrough = NO_TRACING.iterate("x", items)
    per_call = {
        "capture": timeit.timeit(NO_TRACING.capture, number=200_000) / 200_000,
        "tracer_check": timeit.timeit(lambda: NO_TRACING.tracer is not None, number=200_000)
        / 200_000,
        "iterate_step": timeit.timeit(lambda: next(passthrough), number=200_000) / 200_000,
    }
    # per verify: one capture, two `tracer is None` checks (client span, engine batch), one step
    return 1e9 * (per_call["capture"] + 2 * per_call["tracer_check"] + per_call["iterate_step"])


def main() -> None:
    args = alternating_args(__doc__.splitlines()[0])

    from fedge.edge.prompts import heldout_prompts
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.zoo import ensure_zoo

    zoo = ensure_zoo("micro")
    model = load_causal_lm(zoo.target_dir)
    prompt = heldout_prompts(load_tokenizer(zoo.target_dir), 1, 32)[0]
    names = ("baseline", "tracing", "limits", "tls+auth")
    material = tempfile.TemporaryDirectory(prefix="fedge-bench-tls-")
    secure = secure_material(Path(material.name), devices=1)
    running = {name: start(name, zoo, model, secure) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    clients = {name: client for name, (_, client) in running.items()}
    load_before = os.getloadavg()
    alternating_verifies(clients, prompt[:DRAFT], prompt, 5)  # warm-up
    for _ in range(args.rounds):
        for name, seconds in alternating_verifies(
            clients, prompt[:DRAFT], prompt, args.verifies
        ).items():
            samples[name] += seconds
    for server, client in running.values():
        client.close_channel()
        server.stop(grace_s=0.2)
    material.cleanup()
    stats = percentiles(samples)
    base = stats["baseline"]
    for name in names[1:]:
        stats[name]["p50_ratio"] = stats[name]["p50_ms"] / base["p50_ms"]
        stats[name]["p99_ratio"] = stats[name]["p99_ms"] / base["p99_ms"]
    off_ns = off_path_ns()
    result = {
        "bench": "tracing_limits",
        "model": "micro",
        "verifies_per_config": args.rounds * args.verifies,
        "draft_tokens": DRAFT,
        "configs": stats,
        "off_path_ns_per_verify": off_ns,
        "off_path_fraction_of_p50": off_ns / (base["p50_ms"] * 1e6),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
