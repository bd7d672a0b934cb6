"""Typer options shared by `fedge verifier serve` and `fedge verifier fleet`: one definition each.

Kept free of heavy imports (no torch, grpc or opentelemetry) so `--help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedge.edge.verifier.rate_config import RateLimitConfig

TOKEN_ENV = "FEDGE_VERIFIER_TOKEN"
TRACING_ENV = "FEDGE_TRACING"  # = fedge.edge.tracing.TRACING_ENV
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"

ModelOption = Annotated[Path, typer.Option(help="Base model dir (Hugging Face format).")]
AdapterOption = Annotated[Path | None, typer.Option(help="peft LoRA adapter dir, merged at load.")]
RequireTokenOption = Annotated[
    str | None,
    typer.Option(envvar=TOKEN_ENV, help=f"Require this bearer token (or ${TOKEN_ENV})."),
]
CredentialsOption = Annotated[
    Path | None,
    typer.Option(
        "--credentials",
        help="Per-device credentials file, one 'IDENTITY TOKEN' line per device, read at start; "
        "the identity keys rate limits, quotas and session ownership.",
    ),
]
TlsCertOption = Annotated[
    Path | None, typer.Option(help="PEM certificate chain: serve TLS (with --tls-key).")
]
TlsKeyOption = Annotated[Path | None, typer.Option(help="PEM private key (with --tls-cert).")]
TlsClientCaOption = Annotated[
    Path | None,
    typer.Option(help="PEM CA: require client certificates it signed (mTLS; with --tls-cert)."),
]
MaxBatchOption = Annotated[int, typer.Option(help="Verifies per batched forward pass.")]
MaxDraftOption = Annotated[int, typer.Option(help="Longest accepted draft.")]
SessionTtlOption = Annotated[float, typer.Option(help="Idle session lifetime, seconds.")]
VerifyRateOption = Annotated[
    float | None,
    typer.Option(help="Per-device verify tokens (draft + 1 per Verify) per second; off if unset."),
]
VerifyBurstOption = Annotated[int, typer.Option(help="Per-device verify token bucket size.")]
VERIFY_BURST = RateLimitConfig.verify_burst  # the bursts' defaults: RateLimitConfig's, one source
GENERATE_BURST = RateLimitConfig.generate_burst
PREFILL_BURST = RateLimitConfig.prefill_burst
GENERATE_RATE = RateLimitConfig.generate_rate  # metered by default; 0 on the command line = off
PREFILL_RATE = RateLimitConfig.prefill_rate
PrefillRateOption = Annotated[
    float | None,
    typer.Option(
        help="Per-device tokens prefilled per second by opens, reopens and Generate prompts; "
        "0 = off."
    ),
]
PrefillBurstOption = Annotated[
    int, typer.Option(help="Per-device prefill bucket size (a longer prompt waits for a full one).")
]
SessionsPerDeviceOption = Annotated[
    int | None,
    typer.Option(
        help="Sessions one authenticated device may hold per verifier; unset = 16 (capped at "
        "--max-sessions), 0 = off (each device still gets its fair share of the table)."
    ),
]
GenerateRateOption = Annotated[
    float | None,
    typer.Option(help="Per-device Generate tokens (max_new_tokens) per second; 0 = off."),
]
GenerateBurstOption = Annotated[
    int, typer.Option(help="Per-device Generate token bucket size (largest max_new_tokens).")
]
TracingOption = Annotated[
    str,
    typer.Option(
        envvar=TRACING_ENV,
        help=f"OpenTelemetry span exporter: none, console or otlp (or ${TRACING_ENV}).",
    ),
]
OtlpEndpointOption = Annotated[
    str | None,
    typer.Option(
        envvar=OTLP_ENDPOINT_ENV,
        help=f"OTLP gRPC collector for --tracing otlp (or ${OTLP_ENDPOINT_ENV}).",
    ),
]


def rate_limits(
    verify_rate: float | None,
    verify_burst: int,
    generate_rate: float | None,
    generate_burst: int,
    prefill_rate: float | None = PREFILL_RATE,
    prefill_burst: int = PREFILL_BURST,
) -> RateLimitConfig:
    """The per-device limits the rate options describe (a rate of 0 turns that kind off)."""
    return RateLimitConfig(
        verify_rate=verify_rate or None,
        verify_burst=verify_burst,
        generate_rate=generate_rate or None,
        generate_burst=generate_burst,
        prefill_rate=prefill_rate or None,
        prefill_burst=prefill_burst,
    )
