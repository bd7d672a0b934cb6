"""Generated stubs are reproducible from the proto; router policies and the draft-length heuristic."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.proto import codegen
from edge.router import LinkEstimates, Route, Router, RouterConfig, predict


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    for generated in codegen.generate(tmp_path):
        committed = codegen.PROTO_DIR / generated.name
        assert generated.read_text() == committed.read_text(), f"{generated.name}: run `make proto`"


def measured(rtt: float, acceptance: float = 0.8) -> Router:
    """A router with every route measured: draft 1 ms/token, verify 5 ms, cloud 4 ms/token, g = 4."""
    router = Router(RouterConfig(smoothing=1.0, new_tokens=64))
    router.observe_rtt(rtt)
    router.observe_speculative(
        draft_step_s=0.001, verify_s=0.005, acceptance=acceptance, draft_len=4
    )
    router.observe_cloud(token_s=0.004)
    return router


def test_predictions_follow_the_formulas() -> None:
    # spec: E(0.8, 4) = (1 - 0.8^5) / 0.2 = 3.3616 tokens per (4 * 1 + 20 + 5) ms round
    # cloud: 64 tokens / (20 ms + 64 * 4 ms); edge: 1 / 1 ms
    pred = predict(measured(0.020).estimates, 64)
    assert pred["speculative"] == pytest.approx(3.3616 / 0.029)
    assert pred["cloud-only"] == pytest.approx(64 / 0.276)
    assert pred["edge-only"] == pytest.approx(1000.0)


def test_latency_objective_switches_to_the_cloud_at_high_rtt() -> None:
    assert measured(0.0).choose().route == Route.SPECULATIVE  # 3.36 / 9 ms beats 1 / 4 ms
    assert (
        measured(0.100).choose().route == Route.CLOUD_ONLY
    )  # 3.36 / 109 ms loses to ~3.9 ms/token


def test_capacity_objective_keeps_speculating_within_slack() -> None:
    router = measured(0.010)  # spec 3.36 / 19 ms = 177/s, cloud 64 / 266 ms = 241/s
    assert router.choose().route == Route.CLOUD_ONLY
    capacity = Router(RouterConfig(objective="capacity", capacity_slack=1.5, smoothing=1.0))
    capacity.estimates = router.estimates
    assert capacity.choose().route == Route.SPECULATIVE  # 177 * 1.5 >= 241


def test_unmeasured_routes_are_explored_and_offline_means_edge() -> None:
    router = Router()
    assert router.choose().route == Route.SPECULATIVE
    router.observe_speculative(0.001, 0.005, 0.5, 4)
    assert router.choose().route == Route.CLOUD_ONLY
    router.verifier_down()
    assert router.choose().route == Route.EDGE_ONLY
    allowed = Router(RouterConfig(allow_edge_only=True, smoothing=1.0))
    allowed.estimates = LinkEstimates(
        rtt_s=0.1, draft_step_s=0.001, verify_s=0.005, cloud_token_s=0.004, acceptance=0.5
    )
    assert allowed.choose().route == Route.EDGE_ONLY


def test_router_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match=r"RouterConfig.objective must be one of"):
        RouterConfig(objective="cheapest")
