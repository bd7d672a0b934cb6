"""The Serve builders a RayService names: args map onto FleetConfig, bad args are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.edge.fleet.kuberay import fleet_config, ingress_app, replicas_app


def test_args_map_onto_the_fleet_and_engine() -> None:
    config = fleet_config(
        {
            "model": "/models/target",
            "adapter": "/models/adapter",
            "replicas": 3,
            "max_replicas": 5,
            "policy": "least-outstanding",
            "max_draft": 12,
            "session_ttl_s": 60.0,
        }
    )
    assert (config.model_dir, config.adapter_dir) == (
        Path("/models/target"),
        Path("/models/adapter"),
    )
    assert (config.replicas, config.max_replicas, config.policy) == (3, 5, "least-outstanding")
    assert (config.engine.max_draft, config.engine.session_ttl_s) == (12, 60.0)


def test_ingress_secrets_are_paths_read_at_start_never_arguments() -> None:
    args = {"stable": "fedge-v1", "credentials_file": "/run/c", "tls_cert": "/run/t.crt"}
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ingress_app(args)
    spec = ingress_app({**args, "tls_key": "/run/t.key"})._bound_deployment.init_args[0]
    assert (spec.credentials_file, spec.tls_key) == (Path("/run/c"), Path("/run/t.key"))


@pytest.mark.parametrize(
    ("builder", "args", "message"),
    [
        (replicas_app, {"model": "/m", "replica": 2}, "unknown args ['replica']"),
        (replicas_app, {"replicas": 2}, "args.model"),
        (replicas_app, {"model": "/m", "policy": "random"}, "unknown load-balancing policy"),
        (replicas_app, {"model": "/m", "replicas": 3, "max_replicas": 2}, "max_replicas"),
        (ingress_app, {"port": 50061}, "args.stable"),
        (ingress_app, {"stable": "fedge-v1", "port": 70000}, "IngressSpec.port"),
        (ingress_app, {"stable": "fedge-v1", "adapter": "/a"}, "unknown args ['adapter']"),
        (ingress_app, {"stable": "fedge-v1", "verify_rate": -1}, "RateLimitConfig.verify_rate"),
    ],
)
def test_bad_args_are_refused_by_name(builder, args, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        builder(args)
