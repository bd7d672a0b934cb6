"""The Serve builders a RayService names: args map onto FleetConfig, bad args are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.fleet.kuberay import TOKEN_ENV, fleet_config, ingress_app, replicas_app


def test_args_map_onto_the_fleet_and_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-a-secret")
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
    assert config.token == "from-a-secret"


def test_no_token_in_the_environment_means_no_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert fleet_config({"model": "/m"}).token is None


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
