"""The virtual clock on hand-computed cases: round time, deadline, partial work, first K, churn.

Every case uses devices with round numbers (latency 0.1 s, downlink 8 Mbit/s = 1 MB/s,
uplink 4 Mbit/s = 0.5 MB/s) and a leg of 1 MB down, 1 MB up, 10 steps of 0.5 s, so::

    begin  = start + 0.1 + 1.0            (latency + download)
    finish = begin + 10 x 0.5 + 2.0       (compute + upload)  = start + 8.1
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedge.simulations.devicesim.clock import (
    DEADLINE,
    KEPT,
    LATE,
    OFFLINE,
    Leg,
    Rules,
    plan_exchange,
)
from fedge.simulations.devicesim.population import Population, _pack

MB = 1e6


def pop(
    n: int,
    availability: list[list[tuple[float, float]]] | None = None,
    step_scale: list[float] | None = None,
) -> Population:
    """``n`` identical devices; optional eligible intervals per device (empty list: always)."""
    intervals = availability or [[] for _ in range(n)]
    offsets, starts, ends = _pack(intervals)
    return Population(
        ("test",),
        np.zeros(n, dtype=np.int16),
        np.zeros(n, dtype=np.int8),
        np.ones(n),
        np.full(n, 1e9),
        np.full(n, 4e6),
        np.full(n, 8e6),
        np.full(n, 0.1),
        offsets,
        starts,
        ends,
        np.zeros(n),
    )


def leg(node: int, step_seconds: float = 0.5, steps: int = 10) -> Leg:
    return Leg(node, node, 1 * MB, 1 * MB, steps, step_seconds)


def test_round_time_is_download_compute_upload_latency() -> None:
    """8.1 s = 1.0 download + 5.0 compute + 2.0 upload + 0.1 latency, the clock closes there."""
    plan = plan_exchange([leg(0)], pop(1), Rules(start=100.0))
    (o,) = plan.outcomes
    assert o.status == KEPT and o.steps == 10
    assert o.begin == pytest.approx(101.1)
    assert o.finish == pytest.approx(108.1)
    assert o.compute_seconds == pytest.approx(5.0) and o.wasted_seconds == 0
    assert plan.close == pytest.approx(108.1)


def test_deadline_with_partial_work_runs_the_steps_that_fit() -> None:
    """Deadline at 106: (106 - 101.1 - 2.0) / 0.5 = 5.8, so 5 steps, reporting at 105.6."""
    plan = plan_exchange(
        [leg(0)], pop(1), Rules(start=100.0, deadline_at=106.0, accept_partial=True)
    )
    (o,) = plan.outcomes
    assert o.status == KEPT and o.partial and o.steps == 5 and o.requested == 10
    assert o.finish == pytest.approx(105.6)
    assert plan.close == pytest.approx(105.6)


def test_deadline_without_partial_work_drops_the_client_and_wastes_its_compute() -> None:
    """FedAvg/SCAFFOLD: no report by 106; it computed 106 - 101.1 = 4.9 s, all wasted; round closes at 106."""
    plan = plan_exchange([leg(0)], pop(1), Rules(start=100.0, deadline_at=106.0))
    (o,) = plan.outcomes
    assert o.status == DEADLINE
    assert o.wasted_seconds == pytest.approx(4.9)
    assert plan.close == pytest.approx(106.0)


def test_a_deadline_too_tight_for_one_step_drops_even_under_fedprox() -> None:
    """Deadline at 103.5: 103.5 - 101.1 - 2.0 = 0.4 s < one 0.5 s step."""
    plan = plan_exchange(
        [leg(0)], pop(1), Rules(start=100.0, deadline_at=103.5, accept_partial=True)
    )
    assert plan.outcomes[0].status == DEADLINE


def test_over_selection_keeps_the_first_k_reports() -> None:
    """Step times 0.2, 0.5, 0.3 s: finishes at 105.1, 108.1, 106.1; K = 2 keeps nodes 0 and 2.

    The round closes at the second report (106.1); node 1 began computing at 101.1 and
    had done 5.0 s by then: all of it wasted.
    """
    legs = [leg(0, 0.2), leg(1, 0.5), leg(2, 0.3)]
    plan = plan_exchange(legs, pop(3), Rules(start=100.0, target=2))
    status = {o.node: o.status for o in plan.outcomes}
    assert status == {0: KEPT, 1: LATE, 2: KEPT}
    assert plan.close == pytest.approx(106.1)
    late = plan.by_status(LATE)[0]
    assert late.wasted_seconds == pytest.approx(5.0)


def test_too_few_reports_close_at_the_deadline() -> None:
    """K = 2 but one client cannot make the deadline: the server waits until the deadline."""
    legs = [leg(0, 0.2), leg(1, 0.9)]
    plan = plan_exchange(legs, pop(2), Rules(start=100.0, deadline_at=107.0, target=2))
    assert [o.status for o in plan.outcomes] == [KEPT, DEADLINE]
    assert plan.close == pytest.approx(107.0)


def test_a_device_whose_availability_ends_mid_round_drops_out() -> None:
    """Eligible 0-104 only: it vanishes at 104 after 104 - 101.1 = 2.9 s of compute (wasted)."""
    plan = plan_exchange([leg(0)], pop(1, [[(0.0, 104.0)]]), Rules(start=100.0))
    (o,) = plan.outcomes
    assert o.status == OFFLINE
    assert o.finish == pytest.approx(104.0)
    assert o.wasted_seconds == pytest.approx(2.9)
    assert o.downloaded  # it vanished after receiving the adapter (bytes down counted)


def test_a_device_offline_at_the_start_never_begins() -> None:
    plan = plan_exchange([leg(0)], pop(1, [[(200.0, 300.0)]]), Rules(start=100.0))
    (o,) = plan.outcomes
    assert o.status == OFFLINE and o.compute_seconds == 0 and plan.close == 100.0
    assert not o.downloaded


def test_periodic_availability_wraps_into_the_next_cycle() -> None:
    """Period 100 s, eligible 90-100 and 0-20: at t=195 the device stays eligible until 220."""
    p = pop(1, [[(0.0, 20.0), (90.0, 100.0)]])
    p = Population(
        *[getattr(p, f) for f in p.__dataclass_fields__ if f != "period_s"], np.array([100.0])
    )
    assert p.available_until(0, 195.0) == pytest.approx(220.0)
    assert p.available_until(0, 150.0) is None
    assert p.available_until(0, 10.0) == pytest.approx(20.0)
    assert math.isinf(pop(1).available_until(0, 1e9) or 0.0)


def test_a_deadline_dropout_wastes_compute_only_until_the_round_closes() -> None:
    """K = 1: node 0 (0.2 s steps) reports at 105.1 and closes the round; node 1 (0.9 s steps)
    would miss the 107 deadline. It began at 101.1 and stops at the close: 4.0 s wasted, 4
    steps run (on main it was charged until the deadline, 5.9 s, as if the round stayed open)."""
    legs = [leg(0, 0.2), leg(1, 0.9)]
    plan = plan_exchange(legs, pop(2), Rules(start=100.0, deadline_at=107.0, target=1))
    assert plan.close == pytest.approx(105.1)
    dropped = plan.outcomes[1]
    assert dropped.status == DEADLINE
    assert dropped.wasted_seconds == pytest.approx(4.0)
    assert dropped.steps == 4 and dropped.finish == pytest.approx(105.1)


def test_a_device_leaving_after_the_close_wastes_only_compute_until_the_close() -> None:
    """K = 1 closes at 105.1; node 1 (eligible until 106) would vanish mid-training at 106:
    it too stops at the close, 4.0 s wasted (the step time is 0.5 s: 8 steps)."""
    legs = [leg(0, 0.2), leg(1, 0.5)]
    plan = plan_exchange(legs, pop(2, [[], [(0.0, 106.0)]]), Rules(start=100.0, target=1))
    gone = plan.outcomes[1]
    assert gone.status == OFFLINE and gone.wasted_seconds == pytest.approx(4.0)
    assert gone.steps == 8
