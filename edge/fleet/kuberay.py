"""Ray Serve application builders: the fleet declared in a Serve config (KubeRay RayService, `serve deploy`).

A Serve config names an application by `import_path` and hands it `args`; these
builders turn those args into the same applications `fedge verifier fleet` deploys
imperatively (`fedge.edge.fleet.app`): `replicas_app` is one model version's `verifier`
deployment of N replicas behind the chosen request router, `ingress_app` the gRPC
front door speaking `fedge.edge.v1.Verifier` on `host:port`. The ingress's
secrets (the devices' credentials file, the TLS key) are named by path: Kubernetes
mounts them from Secrets as files and the ingress reads them when it starts, so
no secret sits in the config, in an environment variable or in a pickled argument
(deploy/k8s).

On KubeRay the config is declarative: a new adapter version is rolled out by adding
its application (and moving the ingress's `stable`) in the RayService, not by
`fedge verifier rollout`, whose imperatively added applications the operator would
remove on its next reconcile.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedge.edge.fleet.app import FleetConfig, ingress_application, replica_application
from fedge.edge.fleet.ingress_spec import IngressSpec
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.limits import RateLimitConfig

LIMIT_ARGS = (  # RateLimitConfig
    "verify_rate",
    "verify_burst",
    "generate_rate",
    "generate_burst",
    "prefill_rate",
    "prefill_burst",
)
VERSION_ARGS = {  # arg -> FleetConfig field (or EngineConfig field under engine.)
    "model": "model_dir",
    "adapter": "adapter_dir",
    "replicas": "replicas",
    "min_replicas": "min_replicas",
    "max_replicas": "max_replicas",
    "policy": "policy",
    "affinity": "affinity",
    "target_queue": "target_queue",
    "replica_cpus": "replica_cpus",
    "max_draft": "engine.max_draft",
    "max_batch": "engine.max_batch",
    "session_ttl_s": "engine.session_ttl_s",
    "max_sessions_per_device": "engine.max_sessions_per_token",
    "fleet_key_file": "fleet_key_file",
}
SECRET_FILE_ARGS = (  # paths
    "credentials_file",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "redis_password_file",
    "fleet_key_file",
)
INGRESS_ARGS = ("stable", "host", "port", "replicas", "redis_url", *SECRET_FILE_ARGS, *LIMIT_ARGS)


def _check(args: Mapping[str, Any], known: Any, app: str) -> None:
    """Refuse args the builder does not know, naming them and the known ones."""
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(
            f"{app} application: unknown args {unknown}; known: {', '.join(sorted(known))}"
        )


def fleet_config(args: Mapping[str, Any]) -> FleetConfig:
    """The FleetConfig of a `replicas_app` args mapping (model required; paths as strings)."""
    _check(args, VERSION_ARGS, "version")
    if "model" not in args:
        raise ValueError("version application: args.model (the base model directory) is required")
    fleet: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for arg, value in args.items():
        field = VERSION_ARGS[arg]
        if field in ("model_dir", "adapter_dir", "fleet_key_file"):
            value = None if value is None else Path(value)
        if field.startswith("engine."):
            engine[field.removeprefix("engine.")] = value
        else:
            fleet[field] = value
    return FleetConfig(engine=EngineConfig(**engine), **fleet)


def replicas_app(args: dict[str, Any]) -> Any:
    """Serve builder: one model version's `verifier` deployment (see VERSION_ARGS)."""
    return replica_application(fleet_config(args))


def ingress_app(args: dict[str, Any]) -> Any:
    """Serve builder: `replicas` gRPC ingresses in front of application `stable` on `host:port`.

    Their epoch is a digest of the args: a restarted ingress (or a rebuilt controller)
    adopts the routing stored in Redis, promotions included, while a changed declaration
    (a new `stable`, new limits) is written over it.
    """
    _check(args, INGRESS_ARGS, "ingress")
    if "stable" not in args:
        raise ValueError("ingress application: args.stable (the version application) is required")
    files = {k: Path(args[k]) if args.get(k) is not None else None for k in SECRET_FILE_ARGS}
    spec = IngressSpec(
        str(args["stable"]),
        str(args.get("host", "0.0.0.0")),
        int(args.get("port", 50061)),
        credentials_file=files["credentials_file"],
        tls_cert=files["tls_cert"],
        tls_key=files["tls_key"],
        tls_client_ca=files["tls_client_ca"],
        redis_url=args.get("redis_url"),
        redis_password_file=files["redis_password_file"],
        fleet_key_file=files["fleet_key_file"],
        rate_limits=RateLimitConfig(**{k: v for k, v in args.items() if k in LIMIT_ARGS}),
        epoch=hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:32],
    )
    return ingress_application(spec, int(args.get("replicas", 1)))
