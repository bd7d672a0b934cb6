"""Router policies against hand-derived expectations.

Two measured outcomes at RTT 20 ms, 48 tokens each (smoothing 1, so estimates equal them):

- speculative: 1.2 s (25 ms/token, 40 tokens/s), TTFT 50 ms, 12 passes, 4,800 bytes, 12 round
  trips, 48 draft steps, 0.6 s waiting on the cloud -> per token 0.25 passes, 100 bytes,
  1 draft step, 0.25 round trips, cloud share 0.5;
- cloud-only: 0.48 s (10 ms/token, 100 tokens/s), TTFT 30 ms, 48 passes, 480 bytes, 1 round
  trip, all of it in the cloud -> per token 1 pass, 10 bytes, 1/48 round trips, share 1.

Costs with the default weights (pass 1, byte 1e-5, joule 10; 3 mJ per draft token, 1 uJ/byte):
speculative 0.25 + 0.001 + 10 * (0.003 + 0.0001) = 0.282; cloud-only 1 + 0.0001 + 10 * 1e-5
= 1.0002.
"""

from __future__ import annotations

import pytest

from edge.router import (
    DeviceState,
    Objective,
    Outcome,
    Route,
    Router,
    RouterConfig,
    Thermal,
    predict,
)

SPEC = Outcome(Route.SPECULATIVE, 48, 1.2, 0.05, 12, 4800, 12, 48, 0.6, 0.02)
CLOUD = Outcome(Route.CLOUD_ONLY, 48, 0.48, 0.03, 48, 480, 1, 0, 0.48, 0.02)


class Clock:
    """A settable clock for the overload cooldown."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def measured(rtt: float = 0.02, clock: Clock | None = None) -> Router:
    router = Router(RouterConfig(smoothing=1.0), clock=clock or Clock())
    router.observe(SPEC)
    router.observe(CLOUD)
    router.observe_rtt(rtt)
    return router


def test_predictions_and_costs_follow_the_formulas() -> None:
    router = measured()
    spec = predict(router.state, Route.SPECULATIVE, router.device)
    cloud = predict(router.state, Route.CLOUD_ONLY, router.device)
    assert spec is not None and cloud is not None
    assert spec.tokens_per_s == pytest.approx(40.0)
    assert spec.cost == pytest.approx(0.282)
    assert cloud.tokens_per_s == pytest.approx(100.0)
    assert cloud.cost == pytest.approx(1.0002)
    assert predict(router.state, Route.EDGE_ONLY, router.device) is None  # never measured


def test_cheapest_meeting_route_wins() -> None:
    decision = measured().choose()  # both clear 15 * 1.1 tokens/s: speculative is cheaper
    assert decision.route == Route.SPECULATIVE
    assert decision.reason == "cheapest route meeting the objective"


def test_rtt_shift_moves_predictions_and_the_choice() -> None:
    """At 200 ms each round trip costs 180 ms more: speculative 25 + 0.25 * 180 = 70 ms/token
    (14.3/s, misses 16.5); cloud-only 10 + 180/48 = 13.75 ms/token, TTFT 210 ms: meets."""
    router = measured(rtt=0.2)
    spec = predict(router.state, Route.SPECULATIVE, router.device)
    cloud = predict(router.state, Route.CLOUD_ONLY, router.device)
    assert spec is not None and cloud is not None
    assert spec.tokens_per_s == pytest.approx(1 / 0.07)
    assert cloud.tokens_per_s == pytest.approx(1 / 0.01375)
    assert cloud.ttft_s == pytest.approx(0.21)
    assert router.choose().route == Route.CLOUD_ONLY


def test_an_overstated_ping_never_predicts_free_tokens() -> None:
    """Speculative measured while a ping said 500 ms: 0.25 round trips/token would remove 125 ms
    from 25 ms per token; only the 12.5 ms spent waiting (share 0.5) can go: 80 tokens/s at 0 ms."""
    router = Router(RouterConfig(smoothing=1.0))
    router.observe(Outcome(Route.SPECULATIVE, 48, 1.2, 0.05, 12, 4800, 12, 48, 0.6, 0.5))
    router.observe_rtt(0.0)
    spec = predict(router.state, Route.SPECULATIVE, router.device)
    assert spec is not None
    assert spec.tokens_per_s == pytest.approx(80.0)
    assert spec.ttft_s == pytest.approx(0.025)  # likewise at most half the 50 ms TTFT goes


def test_demanding_objective_and_none_meeting() -> None:
    router = measured()
    assert router.choose(Objective(tokens_per_s=50)).route == Route.CLOUD_ONLY  # 40 < 55 <= 100
    closest = router.choose(Objective(tokens_per_s=200))  # attainment 0.2 vs 0.5
    assert closest.route == Route.CLOUD_ONLY
    assert closest.reason.startswith("no route meets")
    assert router.choose(Objective(ttft_s=0.04)).route == Route.CLOUD_ONLY  # 50 ms TTFT misses


@pytest.mark.parametrize(
    ("battery", "charging", "thermal", "expected"),
    [
        # serious (x3): 10 * (0.009 + 0.0001) + 0.251 = 0.342 < 1.0002
        (1.0, False, Thermal.SERIOUS, Route.SPECULATIVE),
        # 5% battery weighs joules x20: 200 * 0.0091 + 0.251 = 2.071 > 1.0002 + 0.002
        (0.05, False, Thermal.SERIOUS, Route.CLOUD_ONLY),
        # 5% battery alone: 200 * 0.0031 + 0.251 = 0.871 < 1.0021
        (0.05, False, Thermal.NOMINAL, Route.SPECULATIVE),
        # charging: joules at full-battery price again
        (0.05, True, Thermal.SERIOUS, Route.SPECULATIVE),
        # critical: no drafting at all while the cloud is reachable
        (1.0, True, Thermal.CRITICAL, Route.CLOUD_ONLY),
    ],
)
def test_battery_and_thermal_state(
    battery: float, charging: bool, thermal: Thermal, expected: Route
) -> None:
    router = measured()
    router.device = DeviceState(battery=battery, charging=charging, thermal=thermal)
    assert router.choose().route == expected


def test_queue_depth_and_overload_make_the_cloud_dear_and_slow() -> None:
    """Depth 8 of capacity 8: load 2, so a pass costs 2 and cloud time doubles (speculative:
    half its time is cloud, x1.5). Overload multiplies load by 4 for 5 s, then it lapses."""
    clock = Clock()
    router = measured(clock=clock)
    router.observe_queue_depth(8)
    spec = predict(router.state, Route.SPECULATIVE, router.device)
    assert spec is not None
    assert spec.cost == pytest.approx(0.5 + 0.001 + 0.031)
    assert spec.tokens_per_s == pytest.approx(1 / (0.025 * 1.5))
    router.observe_queue_depth(0)
    router.observe_overload()  # load 4: speculative x2.5 -> 16/s misses 22; cloud x4 -> 25/s
    assert router.choose(Objective(tokens_per_s=20)).route == Route.CLOUD_ONLY
    clock.now += 6.0
    assert router.choose(Objective(tokens_per_s=20)).route == Route.SPECULATIVE


def test_exploration_order_and_network_down() -> None:
    router = Router()
    assert router.choose().route == Route.SPECULATIVE  # edge-only is not feasible by default
    assert router.choose(Objective(draft_ok=True)).route == Route.EDGE_ONLY
    router.observe(SPEC)
    assert router.choose().reason == "measuring cloud-only"
    router.verifier_down()
    assert router.choose().route == Route.EDGE_ONLY  # the only way to answer
    router.observe_rtt(0.02)
    assert router.choose().route == Route.CLOUD_ONLY


def test_draft_suffices_and_is_cheapest() -> None:
    """Edge-only at 30 tokens/s costs 10 * 0.003 = 0.03 per token: chosen when the draft is ok."""
    router = measured()
    router.observe(Outcome(Route.EDGE_ONLY, 48, 1.6, 0.04, drafted=48))
    assert router.choose(Objective(draft_ok=True)).route == Route.EDGE_ONLY
    assert router.choose().route == Route.SPECULATIVE


def test_stale_cheaper_route_is_remeasured_with_doubling_backoff() -> None:
    """Speculative misses at 200 ms; after 16 requests it is tried again, then after 32."""
    router = measured(rtt=0.2)  # spec observed at request 1, cloud at 2
    slow_spec = Outcome(Route.SPECULATIVE, 48, 48 / 14, 0.25, 12, 4800, 12, 48, 2.5, 0.2)
    for _ in range(15):  # requests 3..17: with request 2, 16 requests since speculative's
        assert router.choose().route == Route.CLOUD_ONLY
        router.observe(CLOUD)
    decision = router.choose()
    assert decision.route == Route.SPECULATIVE and decision.reason.startswith("re-measuring")
    router.observe(slow_spec)  # request 18, still too slow: next re-measure 32 requests later
    for _ in range(32):
        assert router.choose().route == Route.CLOUD_ONLY
        router.observe(CLOUD)
    assert router.choose().route == Route.SPECULATIVE


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"Objective\.tokens_per_s"):
        Objective(tokens_per_s=0)
    with pytest.raises(ValueError, match=r"DeviceState\.battery"):
        DeviceState(battery=1.5)
    with pytest.raises(ValueError, match=r"RouterConfig\.smoothing"):
        RouterConfig(smoothing=0)
