"""`fedge edge ...` (export a draft, generate on the device) and `fedge verifier ...` (serve)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fedge.edge.cli_options import (
    GENERATE_BURST,
    GENERATE_RATE,
    PREFILL_BURST,
    PREFILL_RATE,
    TOKEN_ENV,
    VERIFY_BURST,
    AdapterOption,
    CredentialsOption,
    GenerateBurstOption,
    GenerateRateOption,
    MaxBatchOption,
    MaxDraftOption,
    ModelOption,
    OtlpEndpointOption,
    PrefillBurstOption,
    PrefillRateOption,
    RequireTokenOption,
    SessionsPerDeviceOption,
    SessionTtlOption,
    TlsCertOption,
    TlsClientCaOption,
    TlsKeyOption,
    TracingOption,
    VerifyBurstOption,
    VerifyRateOption,
    rate_limits,
)

edge_app = typer.Typer(
    help="Device side: export the draft to ONNX, generate speculatively.", no_args_is_help=True
)
verifier_app = typer.Typer(help="Cloud side: the gRPC verifier service.", no_args_is_help=True)

_console = Console(stderr=True)


@edge_app.command("export")
def export_command(
    model_dir: Annotated[
        Path | None, typer.Argument(help="Hugging Face causal LM dir; default: the zoo's draft.")
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the ONNX files and manifest.")
    ] = Path("edge-draft"),
    preset: Annotated[
        str, typer.Option(help="Zoo preset whose draft to export when MODEL_DIR is omitted.")
    ] = "default",
    quantize: Annotated[
        bool,
        typer.Option(
            "--quantize/--no-quantize", help="Also write the int8 and 4-bit quantized models."
        ),
    ] = True,
    prompts: Annotated[int, typer.Option(help="Held-out validation prompts.")] = 8,
    prompt_len: Annotated[int, typer.Option(help="Tokens per validation prompt.")] = 32,
    target: Annotated[
        Path | None,
        typer.Option(
            help="The model the draft proposes for: quantized variants are then judged by their "
            "agreement with it. Default: the zoo's target, or the one a `fedge models draft` "
            "card names."
        ),
    ] = None,
) -> None:
    """Export MODEL_DIR to ONNX with KV-cache tensors, quantize (int8, 4-bit), validate, write a manifest."""
    from fedge.edge.export import ExportConfig, ExportValidationError, export_draft
    from fedge.edge.prompts import heldout_prompts
    from fedge.models import load_tokenizer
    from fedge.zoo.draft import draft_target

    if model_dir is None:
        from fedge.zoo import ensure_zoo

        zoo = ensure_zoo(preset)
        model_dir, target = zoo.draft_dir, target or zoo.target_dir
    target = target or draft_target(model_dir)
    _console.print(
        f"quantized variants judged by agreement with the target {target}"
        if target
        else "no target known (--target): quantized variants judged by fidelity to the fp32 draft"
    )
    tokenizer = load_tokenizer(model_dir)
    with _console.status(f"exporting {model_dir} to {out}"):
        try:
            manifest = export_draft(
                model_dir,
                out,
                heldout_prompts(tokenizer, prompts, prompt_len),
                ExportConfig(quantize=quantize),
                target,
            )
        except ExportValidationError as err:
            _console.print(f"[red]{err}[/red]")
            raise typer.Exit(1) from err
    for name, variant in manifest["variants"].items():
        state = (
            "[green]valid[/green]"
            if variant["valid"]
            else f"[red]INVALID {variant['failures']}[/red]"
        )
        _console.print(
            f"{name}: {state} max|Δlogit| {variant['max_abs_logit_diff']:.3g} "
            f"(relative {variant['relative_logit_error']:.3g}) "
            f"greedy agreement {variant['greedy_agreement']:.3f} "
            + (
                f"with the target {variant['target_agreement']:.3f} "
                if "target_agreement" in variant
                else ""
            )
            + f"decode {variant['decode_step_s'] * 1e3:.2f} ms/token, {variant['bytes']} bytes"
        )
    _console.print(f"manifest: {out / 'manifest.json'}")


@edge_app.command("generate")
def generate_command(
    prompt: Annotated[str, typer.Option(help="Prompt text.")],
    draft: Annotated[
        Path, typer.Option(help="Export dir (`fedge edge export`) or HF model dir of the draft.")
    ] = Path("edge-draft"),
    verifier: Annotated[
        str | None, typer.Option(help="Verifier HOST:PORT; omit to decode on the device only.")
    ] = None,
    route: Annotated[
        str | None,
        typer.Option(
            help="Force speculative, cloud-only or edge-only; default: the router decides."
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    temperature: Annotated[
        float, typer.Option(help="0 = greedy (identical to the target's greedy output).")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    draft_len: Annotated[int, typer.Option(help="Initial draft length (adapts +2/-1).")] = 4,
    backend: Annotated[
        str, typer.Option(help="Draft runtime: auto, onnx-int4, onnx-int8, onnx-fp32, torch.")
    ] = "auto",
    token: Annotated[
        str | None, typer.Option(envvar=TOKEN_ENV, help=f"Bearer token (or ${TOKEN_ENV}).")
    ] = None,
    credential_file: Annotated[
        Path | None,
        typer.Option(help="File holding this device's bearer token (read at start; not --token)."),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option("--tls-ca", "--root-cert", help="PEM CA of the verifier's certificate: TLS."),
    ] = None,
    tls_server_name: Annotated[
        str | None, typer.Option(help="Name to check the verifier's certificate against.")
    ] = None,
    tls_client_cert: Annotated[
        Path | None, typer.Option(help="PEM client certificate (mTLS; with --tls-client-key).")
    ] = None,
    tls_client_key: Annotated[Path | None, typer.Option(help="PEM client key (mTLS).")] = None,
    added_rtt_ms: Annotated[
        float, typer.Option(help="Simulated network round trip per call, ms.")
    ] = 0.0,
    device_id: Annotated[
        str | None, typer.Option(help="This device's id: the key of the verifier's rate limits.")
    ] = None,
    tracing: TracingOption = "none",
    otlp_endpoint: OtlpEndpointOption = None,
) -> None:
    """Stream a completion of PROMPT as tokens are accepted; print a JSON report to stderr."""
    from fedge.edge.client import ClientConfig, EdgeClient, VerifierClient
    from fedge.edge.decoder import DecodeConfig
    from fedge.edge.export import TOKENIZER_DIR, load_export_tokenizer
    from fedge.edge.runtime import load_draft_runtime
    from fedge.edge.tracing import TracingConfig, shutdown, tracer_provider
    from fedge.edge.verifier.identity import tokenizer_id
    from fedge.models import load_tokenizer

    provider = tracer_provider(TracingConfig(tracing, "fedge-edge", otlp_endpoint))

    runtime = load_draft_runtime(draft, backend)
    tokenizer = (
        load_export_tokenizer(draft) if (draft / TOKENIZER_DIR).is_dir() else load_tokenizer(draft)
    )
    client = None
    if verifier is not None:
        client = VerifierClient(
            ClientConfig(
                verifier,
                token=token,
                token_file=credential_file,
                root_cert=tls_ca,
                tls_server_name=tls_server_name,
                client_cert=tls_client_cert,
                client_key=tls_client_key,
                added_rtt_s=added_rtt_ms / 1e3,
                device_id=device_id,
                tokenizer_id=tokenizer_id(tokenizer),  # a verifier with another one is refused
            ),
            tracer_provider=provider,
        )
    decode = DecodeConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        draft_len=draft_len,
        max_draft=max(12, draft_len),
        stop_token_id=tokenizer.eos_token_id,
    )
    edge = EdgeClient(runtime, tokenizer, client, decode)
    for piece in edge.stream_text(prompt, route):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if edge.last is not None:
        _console.print_json(json.dumps({"draft_runtime": runtime.name, **vars(edge.last)}))
    if client is not None:
        client.close_channel()
    shutdown(provider)


@verifier_app.command("serve")
def serve_command(
    model: ModelOption,
    adapter: AdapterOption = None,
    host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Listen port; 0 = any free port (printed).")] = 50061,
    token: RequireTokenOption = None,
    credentials: CredentialsOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_client_ca: TlsClientCaOption = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus /metrics on this port.")
    ] = None,
    health_port: Annotated[
        int | None,
        typer.Option(help="Also serve grpc.health.v1 alone, plaintext, here (probes under TLS)."),
    ] = None,
    max_batch: MaxBatchOption = 32,
    batch_window_ms: Annotated[
        float, typer.Option(help="Wait this long for a batch to fill.")
    ] = 2.0,
    max_draft: MaxDraftOption = 16,
    max_sessions: Annotated[int, typer.Option(help="Open sessions before LRU eviction.")] = 1024,
    max_sessions_per_device: SessionsPerDeviceOption = None,
    session_ttl_s: SessionTtlOption = 300.0,
    kv_cap_mb: Annotated[int, typer.Option(help="KV cache memory cap, MiB.")] = 1024,
    kv_cap_per_device_mb: Annotated[
        int,
        typer.Option(
            help="KV memory one device may hold, MiB; 0 = its fair share of --kv-cap-mb "
            "(the cap over the devices holding sessions)."
        ),
    ] = 0,
    grace_s: Annotated[float, typer.Option(help="Drain time on SIGTERM, seconds.")] = 5.0,
    torch_threads: Annotated[
        int,
        typer.Option(
            help="Intra-op threads of the target (torch or ONNX Runtime); 0 = torch's default."
        ),
    ] = 0,
    verify_rate: VerifyRateOption = None,
    verify_burst: VerifyBurstOption = VERIFY_BURST,
    generate_rate: GenerateRateOption = GENERATE_RATE,
    generate_burst: GenerateBurstOption = GENERATE_BURST,
    prefill_rate: PrefillRateOption = PREFILL_RATE,
    prefill_burst: PrefillBurstOption = PREFILL_BURST,
    tracing: TracingOption = "none",
    otlp_endpoint: OtlpEndpointOption = None,
    ring_size: Annotated[
        int,
        typer.Option(help="Ring attention worker processes for long prompts; 0 = off."),
    ] = 0,
    ring_threshold: Annotated[
        int, typer.Option(help="Prompts of more tokens than this are prefilled by the ring.")
    ] = 2048,
    ring_block: Annotated[
        int, typer.Option(help="Key positions per attention score block in a ring worker.")
    ] = 256,
    ring_kv_cap_mb: Annotated[int, typer.Option(help="KV cap of each ring worker, MiB.")] = 1024,
    runtime: Annotated[
        str,
        typer.Option(
            help="The target's runtime: torch, onnx (ONNX Runtime on an export of MODEL with "
            "ADAPTER merged, cached under FEDGE_HOME by the weights' digest) or auto (time both "
            "at start, serve the faster). A ring (--ring-size) runs torch."
        ),
    ] = "auto",
) -> None:
    """Serve MODEL (plus ADAPTER) over gRPC until SIGINT/SIGTERM; health is NOT_SERVING while loading and draining."""
    from fedge.edge.tracing import TracingConfig, shutdown, tracer_provider
    from fedge.edge.verifier.engine import EngineConfig
    from fedge.edge.verifier.server import ServerConfig, serve

    if runtime not in ("auto", "torch", "onnx"):
        raise typer.BadParameter(
            f"unknown runtime {runtime!r}; choose auto, torch or onnx", param_hint="--runtime"
        )
    if runtime == "onnx" and ring_size:
        raise typer.BadParameter(
            f"--runtime onnx cannot serve a ring (--ring-size {ring_size}): ring attention's "
            "workers run torch; use --runtime torch or auto with --ring-*, or drop --ring-size",
            param_hint="--runtime",
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = ServerConfig(
        model_dir=model,
        adapter_dir=adapter,
        host=host,
        port=port,
        token=token,
        credentials_file=credentials,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        metrics_port=metrics_port,
        health_port=health_port,
        grace_s=grace_s,
        engine=EngineConfig(
            max_draft=max_draft,
            max_sessions=max_sessions,
            max_sessions_per_token=max_sessions_per_device,
            session_ttl_s=session_ttl_s,
            kv_cap_bytes=kv_cap_mb << 20,
            kv_cap_per_token_bytes=kv_cap_per_device_mb << 20,
            batch_window_s=batch_window_ms / 1e3,
            max_batch=max_batch,
            torch_threads=torch_threads,
            ring_size=ring_size,
            ring_threshold=ring_threshold,
            ring_block=ring_block,
            ring_kv_cap_bytes=ring_kv_cap_mb << 20,
            runtime=runtime,
        ),
        rate_limits=rate_limits(
            verify_rate, verify_burst, generate_rate, generate_burst, prefill_rate, prefill_burst
        ),
    )
    provider = tracer_provider(TracingConfig(tracing, "fedge-verifier", otlp_endpoint))

    def ready(bound: int) -> None:
        sys.stdout.write(f"verifier listening on {host}:{bound}\n")
        sys.stdout.flush()

    try:
        serve(config, on_ready=ready, tracer_provider=provider)
    finally:
        shutdown(provider)
