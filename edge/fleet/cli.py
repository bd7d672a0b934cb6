"""`fedge verifier fleet` (serve a Ray Serve fleet) and `fedge verifier rollout` (canary an adapter)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from fedge.edge.cli_options import (
    GENERATE_BURST,
    GENERATE_RATE,
    PREFILL_BURST,
    PREFILL_RATE,
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

FLEET_FILE = "fleet.json"
_console = Console(stderr=True)

FleetDirOption = Annotated[
    Path, typer.Option(help="The fleet's run dir (its fleet.json names the Ray cluster).")
]


def fleet_command(
    model: ModelOption,
    adapter: AdapterOption = None,
    replicas: Annotated[int, typer.Option(help="Replicas (autoscaling: the starting count).")] = 2,
    policy: Annotated[
        str,
        typer.Option(help="round-robin, least-outstanding, power-of-two or token-aware."),
    ] = "token-aware",
    affinity: Annotated[
        bool, typer.Option("--affinity/--no-affinity", help="Keep a session on its replica.")
    ] = True,
    host: Annotated[str, typer.Option(help="Ingress listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Ingress port; 0 = any free port (printed).")] = 50062,
    credentials: CredentialsOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_client_ca: TlsClientCaOption = None,
    redis_url: Annotated[
        str | None,
        typer.Option(
            help="Redis holding the ingresses' shared state (redis://HOST:PORT/DB, rediss:// for "
            "TLS, unix:///PATH; no password in it); omit to keep it in the one ingress."
        ),
    ] = None,
    redis_password_file: Annotated[
        Path | None, typer.Option(help="File holding the Redis password (read at start).")
    ] = None,
    ingress_replicas: Annotated[
        int, typer.Option(help="Ingresses sharing the port (more than one needs --redis-url).")
    ] = 1,
    min_replicas: Annotated[int, typer.Option(help="Autoscaling lower bound.")] = 1,
    max_replicas: Annotated[
        int | None, typer.Option(help="Autoscaling upper bound; omit for a fixed count.")
    ] = None,
    target_queue: Annotated[
        float, typer.Option(help="Autoscaling target: ongoing calls per replica.")
    ] = 8.0,
    replica_cpus: Annotated[float, typer.Option(help="Ray CPUs reserved per replica.")] = 1.0,
    max_draft: MaxDraftOption = 16,
    max_batch: MaxBatchOption = 32,
    session_ttl_s: SessionTtlOption = 300.0,
    max_sessions_per_device: SessionsPerDeviceOption = None,
    verify_rate: VerifyRateOption = None,
    verify_burst: VerifyBurstOption = VERIFY_BURST,
    generate_rate: GenerateRateOption = GENERATE_RATE,
    generate_burst: GenerateBurstOption = GENERATE_BURST,
    prefill_rate: PrefillRateOption = PREFILL_RATE,
    prefill_burst: PrefillBurstOption = PREFILL_BURST,
    tracing: TracingOption = "none",
    otlp_endpoint: OtlpEndpointOption = None,
    run_dir: Annotated[
        Path, typer.Option(help="Where fleet.json (Ray address, port) goes, for `rollout`.")
    ] = Path("runs/fleet"),
    ray_auth: Annotated[
        bool,
        typer.Option(
            "--ray-auth/--no-ray-auth",
            help="Start Ray with token authentication (token in RUN_DIR/ray-auth-token).",
        ),
    ] = True,
    fleet_key_file: Annotated[
        Path | None,
        typer.Option(
            help="The fleet key (hex, mode 0600): seals the config in the shared state, signs "
            "the identities relayed to replicas; default RUN_DIR/fleet.key, written if missing."
        ),
    ] = None,
) -> None:
    """Serve MODEL as a Ray Serve fleet behind one gRPC ingress (same proto as `serve`) until SIGINT/SIGTERM.

    The ingress authenticates every call (--credentials, --tls-client-ca) before anything
    else; per-device rate limits are enforced there, so they hold across all replicas.
    With --redis-url the ingresses keep routing, sessions, buckets and rollout progress in
    Redis: any ingress may die, and --ingress-replicas N share one port.
    """
    from fedge.edge.fleet.app import FleetConfig, running_fleet
    from fedge.edge.fleet.sealed import KEY_FILE, write_key
    from fedge.edge.tracing import TracingConfig
    from fedge.edge.verifier.engine import EngineConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if fleet_key_file is None:
        fleet_key_file = run_dir / KEY_FILE
        if not fleet_key_file.exists():
            write_key(fleet_key_file)
    config = FleetConfig(
        fleet_key_file=fleet_key_file.resolve(),
        ray_auth=ray_auth,
        model_dir=model,
        adapter_dir=adapter,
        replicas=replicas,
        policy=policy,
        affinity=affinity,
        host=host,
        port=port,
        credentials_file=credentials,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        redis_url=redis_url,
        redis_password_file=redis_password_file,
        ingress_replicas=ingress_replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_queue=target_queue,
        replica_cpus=replica_cpus,
        engine=EngineConfig(
            max_draft=max_draft,
            max_batch=max_batch,
            session_ttl_s=session_ttl_s,
            max_sessions_per_token=max_sessions_per_device,
        ),
        rate_limits=rate_limits(
            verify_rate, verify_burst, generate_rate, generate_burst, prefill_rate, prefill_burst
        ),
        tracing=TracingConfig(tracing, endpoint=otlp_endpoint),
    )
    stopping = threading.Event()

    def listen() -> None:  # a signal asks for the teardown; one during it waits for it to end
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.set())

    listen()
    with running_fleet(config) as fleet:
        import ray

        # ray.init replaced the SIGTERM handler with one raising SystemExit wherever the main
        # thread is: a SIGTERM then tore down half-way (exit by SIGABRT, Ray's agents left
        # running). Ours only sets the event, and the teardown below runs in order.
        listen()

        run_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "ray_address": ray.get_runtime_context().gcs_address,
            "port": fleet.port,
            "fleet_key_file": str(fleet_key_file.resolve()),  # its path, never the key
            "ray_token_file": os.environ.get("RAY_AUTH_TOKEN_PATH", ""),  # its path likewise
            "ray_session_dir": ray._private.worker._global_node.get_session_dir_path(),  # type: ignore[attr-defined]
            "pid": os.getpid(),
        }
        (run_dir / FLEET_FILE).write_text(json.dumps(state))
        sys.stdout.write(f"fleet listening on {host}:{fleet.port}\n")
        sys.stdout.flush()
        stopping.wait()


def rollout_command(
    adapter: Annotated[Path, typer.Option(help="The new peft LoRA adapter dir.")],
    canary: Annotated[float, typer.Option(help="Fraction of new sessions it serves.")] = 0.1,
    window: Annotated[float, typer.Option(help="Observation window, seconds.")] = 60.0,
    min_verifies: Annotated[
        int, typer.Option(help="Verifies per arm before deciding (the window extends).")
    ] = 50,
    min_sessions: Annotated[
        int, typer.Option(help="Sessions per arm before deciding (acceptance is per session).")
    ] = 10,
    run_dir: Annotated[
        Path, typer.Option(help="Directory for rollout.json (decision and figures).")
    ] = Path("runs/rollout"),
    fleet: FleetDirOption = Path("runs/fleet"),
) -> None:
    """Canary ADAPTER on the running fleet, then promote or roll back automatically."""
    from fedge.edge.fleet.rollout import RolloutConfig, run_rollout

    config = RolloutConfig(
        adapter_dir=adapter,
        run_dir=run_dir,
        canary=canary,
        window_s=window,
        min_verifies=min_verifies,
        min_sessions=min_sessions,
        max_window_s=max(600.0, window),
    )
    record = run_rollout(*_connect(fleet), config=config)
    _console.print_json(json.dumps(record))
    if record["decision"] != "promote":
        raise typer.Exit(1)


def _connect(fleet: Path) -> tuple[Any, bytes]:
    """Join the Ray cluster of the fleet started with run dir `fleet`; its ingress's handle and
    the fleet key."""
    import ray
    from ray import serve

    from fedge.edge.fleet.app import INGRESS_APP, NAMESPACE

    state_file = fleet / FLEET_FILE
    if not state_file.is_file():
        raise typer.BadParameter(f"{state_file} is missing; start `fedge verifier fleet` first")
    from fedge.edge.fleet.sealed import load_key

    state = json.loads(state_file.read_text())
    key = load_key(Path(state["fleet_key_file"]))
    if state.get("ray_token_file"):  # the fleet's Ray takes token-authenticated callers only
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = state["ray_token_file"]
    ray.init(address=state["ray_address"], namespace=NAMESPACE, log_to_driver=False)
    return serve.get_app_handle(INGRESS_APP), key


def restart_command(
    adapter: Annotated[
        Path | None,
        typer.Option(help="Upgrade to this adapter dir: through the canary, as `rollout` does."),
    ] = None,
    canary: Annotated[float, typer.Option(help="With --adapter: its share of new sessions.")] = 0.1,
    window: Annotated[float, typer.Option(help="With --adapter: observation window, s.")] = 60.0,
    run_dir: Annotated[
        Path, typer.Option(help="With --adapter: directory for rollout.json.")
    ] = Path("runs/rollout"),
    fleet: FleetDirOption = Path("runs/fleet"),
) -> None:
    """Replace the running fleet's replicas one at a time (Serve's rolling update), failing no call.

    Sessions of a replica being replaced reopen on another from the edge's committed
    tokens. With --adapter it is an upgrade, and it takes the canary path of `rollout`
    (checked numerically, served to a fraction, compared, then promoted or rolled back), so
    no application ever serves two adapters at once.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if adapter is not None:
        rollout_command(adapter, canary, window, run_dir=run_dir, fleet=fleet)
        return
    from fedge.edge.fleet.app import restart_version

    ingress, key = _connect(fleet)
    _console.print_json(json.dumps(restart_version(ingress, key)))


def register(app: typer.Typer) -> None:
    """Attach the fleet commands to the `fedge verifier` group."""
    app.command("fleet")(fleet_command)
    app.command("rollout")(rollout_command)
    app.command("restart")(restart_command)
