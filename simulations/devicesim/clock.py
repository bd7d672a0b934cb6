"""The virtual clock of one exchange: every client's timeline, the deadline and the first K reports.

Nothing here sleeps or trains; it is arithmetic on simulated seconds. One client's leg::

    begin  = start + latency + download_bytes * 8 / downlink       (the request arrives)
    finish = begin + steps * step_seconds + upload_bytes * 8 / uplink   (its report arrives)

* offline: the device is not eligible at ``start``, or its eligible interval ends before
  it reports: it drops out (its compute so far is wasted);
* deadline: the report would arrive after ``deadline_at``. A strategy that accepts partial
  work (FedProx) runs the steps that fit and reports by the deadline; otherwise the
  client drops out and the compute it did before the deadline is wasted, or only the
  compute until the close when the round closed earlier (at the K-th report);
* late: more than ``target`` clients would report; the server keeps the first ``target``
  by arrival and closes the exchange at the last kept report; the others' compute until
  then is wasted (the price of over-selection).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fedge.simulations.devicesim.population import Population

KEPT, OFFLINE, DEADLINE, LATE = "kept", "offline", "deadline", "late"


@dataclass(frozen=True)
class Leg:
    """What one client is asked to do in one exchange."""

    node: int
    device: int
    download_bytes: float
    upload_bytes: float
    steps: int = 0  # local steps (0 for a protocol message that trains nothing)
    step_seconds: float = 0.0


@dataclass(frozen=True)
class Rules:
    """When the exchange starts, when the round must close, and how many reports it needs."""

    start: float
    deadline_at: float = math.inf
    target: int = 0  # keep the first ``target`` reports by arrival; 0 keeps every report
    accept_partial: bool = False


@dataclass(frozen=True)
class Outcome:
    """One client's fate in one exchange (times are absolute simulated seconds)."""

    node: int
    device: int
    status: str  # KEPT, OFFLINE, DEADLINE or LATE
    steps: int  # steps the client runs (kept) or ran before it was dropped
    requested: int  # steps it was asked for
    begin: float  # when the request has arrived (inf: the client was never reached)
    finish: float  # when the report arrives, or when the client dropped out
    compute_seconds: float
    wasted_seconds: float

    @property
    def downloaded(self) -> bool:
        """Whether the client received the message (it was eligible until its download ended)."""
        return self.status != OFFLINE or self.finish >= self.begin

    @property
    def partial(self) -> bool:
        """Whether a kept client runs fewer steps than asked (work cut by the deadline)."""
        return self.status == KEPT and self.steps < self.requested


@dataclass(frozen=True)
class Plan:
    """Every client's outcome and when the exchange closes."""

    outcomes: list[Outcome]
    close: float

    def by_status(self, status: str) -> list[Outcome]:
        """The outcomes with one status, in node order."""
        return [o for o in self.outcomes if o.status == status]


def leg_outcome(leg: Leg, pop: Population, rules: Rules) -> Outcome:
    """The timeline of one client, before the first-K cut."""
    d = leg.device
    until = pop.available_until(d, rules.start)
    if until is None:
        return Outcome(leg.node, d, OFFLINE, 0, leg.steps, math.inf, rules.start, 0.0, 0.0)
    begin = (
        rules.start + float(pop.latency_s[d]) + leg.download_bytes * 8 / float(pop.downlink_bps[d])
    )
    upload = leg.upload_bytes * 8 / float(pop.uplink_bps[d])
    steps = leg.steps
    finish = begin + steps * leg.step_seconds + upload
    if finish > rules.deadline_at:
        fit = 0
        if rules.accept_partial and steps > 0:
            fit = min(steps, math.floor((rules.deadline_at - begin - upload) / leg.step_seconds))
        if fit < 1:
            gone = min(until, rules.deadline_at)
            return _dropped(
                leg, steps, begin, gone, OFFLINE if gone < rules.deadline_at else DEADLINE
            )
        steps, finish = fit, begin + fit * leg.step_seconds + upload
    if until < finish:
        return _dropped(leg, steps, begin, until, OFFLINE)
    compute = steps * leg.step_seconds
    return Outcome(leg.node, d, KEPT, steps, leg.steps, begin, finish, compute, 0.0)


def _dropped(leg: Leg, steps: int, begin: float, gone: float, status: str) -> Outcome:
    """A client that stopped at ``gone`` after computing what fits before it (all of it wasted)."""
    done = min(steps * leg.step_seconds, max(0.0, gone - begin))
    ran = math.floor(done / leg.step_seconds) if leg.step_seconds > 0 else 0
    return Outcome(leg.node, leg.device, status, ran, leg.steps, begin, gone, done, done)


def plan_exchange(legs: Sequence[Leg], pop: Population, rules: Rules) -> Plan:
    """Every client's outcome, the first ``target`` reports kept, and the closing time."""
    outcomes = [leg_outcome(leg, pop, rules) for leg in legs]
    reports = sorted((o for o in outcomes if o.status == KEPT), key=lambda o: (o.finish, o.node))
    if rules.target and len(reports) >= rules.target:
        close = reports[rules.target - 1].finish
        late = {o.node for o in reports[rules.target :]}
    else:
        waits = [o.finish for o in outcomes if o.status in (KEPT, OFFLINE)]
        if any(o.status == DEADLINE for o in outcomes):
            waits.append(rules.deadline_at)
        close, late = max(waits, default=rules.start), set()
    final = []
    for leg, o in zip(legs, outcomes, strict=True):
        if o.node in late:
            done = min(o.compute_seconds, max(0.0, close - o.begin))
            o = Outcome(o.node, o.device, LATE, o.steps, o.requested, o.begin, o.finish, done, done)
        elif o.status != KEPT and o.finish > close:
            o = _stopped_at_close(o, close, leg.step_seconds)
        final.append(o)
    return Plan(final, close)


def _stopped_at_close(o: Outcome, close: float, step_seconds: float) -> Outcome:
    """A client still computing when the round closed stops then: only its compute until the
    close is wasted (not until the deadline, or until it would have gone offline)."""
    done = min(o.compute_seconds, max(0.0, close - o.begin))
    ran = math.floor(done / step_seconds + 1e-9) if step_seconds > 0 else 0
    return Outcome(o.node, o.device, o.status, ran, o.requested, o.begin, close, done, done)
