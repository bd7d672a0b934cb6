"""Serving figures: per application (the canary rollout compares them) and per replica (policy diagnosis)."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Server-side failures. NOT_FOUND (a lost session the edge reopens), INVALID_ARGUMENT and
# FAILED_PRECONDITION (the caller's mistakes) and RESOURCE_EXHAUSTED (backpressure) are not.
ERROR_CODES = frozenset({"UNKNOWN", "INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "DATA_LOSS"})
LATENCY_METHODS = frozenset({"OpenSession", "Verify"})  # one target pass each; streams are not
LATENCY_WINDOW = 20_000  # most recent calls kept for the percentiles
SESSION_WINDOW = 20_000  # most recent sessions kept for the per-session acceptance


@dataclass(frozen=True)
class CallOutcome:
    """One finished call as the canary figures count it: what it was, how it ended, what it cost.

    The ingress builds one per relayed call and carries it to whichever state keeps the
    figures (`FleetState.record_arm`), so the fields are named once.
    """

    method: str  # the Verifier method's short name, e.g. "Verify"
    code: str  # the gRPC status code's name, e.g. "OK"
    seconds: float  # from the ingress receiving the call to its answer
    drafted: int  # draft tokens the call carried (0 for other methods)
    accepted: int  # of those, accepted by the target
    session_id: str = ""
    owner: str = ""  # the authenticated caller ("" on an open ingress)


@dataclass
class ArmStats:
    """Running figures of one application (the stable adapter or the canary).

    Latency is of successful calls only: fast refusals (UNAUTHENTICATED, INVALID_ARGUMENT)
    would otherwise dilute an arm's percentiles and hide a slower adapter.

    Acceptance is kept per session too: a session's drafts share its prompt and its
    draft's luck, so its tokens are not independent trials. The session is the unit
    (`session_acceptance`: the mean of the sessions' accepted / drafted, with its
    standard error over sessions), and a few long sessions cannot outweigh many short
    ones as they do in the pooled `acceptance` (accepted / drafted over all tokens).
    """

    calls: int = 0
    errors: int = 0
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    sessions: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)  # drafted, accepted

    def record(self, call: CallOutcome) -> None:
        """Count one finished call."""
        self.calls += 1
        self.errors += call.code in ERROR_CODES
        if call.code == "OK" and call.method == "Verify":
            self.verifies += 1
            self.drafted += call.drafted
            self.accepted += call.accepted
            unit = observation_unit(call)
            if unit and call.drafted > 0:
                counts = self.sessions.setdefault(unit, [0, 0])
                counts[0] += call.drafted
                counts[1] += call.accepted
                self.sessions.move_to_end(unit)
                if len(self.sessions) > SESSION_WINDOW:
                    self.sessions.popitem(last=False)
        if call.code == "OK" and call.method in LATENCY_METHODS:  # a fast refusal: no serving time
            self.latencies.append(call.seconds)

    def summary(self) -> dict[str, float]:
        """Counts, acceptance (pooled and per session, with its standard error), error rate
        and latency p50/p99 in ms."""
        latency = np.asarray(self.latencies, dtype=float) * 1e3
        rates = np.asarray([a / d for d, a in self.sessions.values()], dtype=float)
        return {
            "calls": self.calls,
            "errors": self.errors,
            "error_rate": self.errors / self.calls if self.calls else 0.0,
            "verifies": self.verifies,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "sessions": int(rates.size),
            "session_acceptance": float(rates.mean()) if rates.size else 0.0,
            "session_acceptance_se": session_standard_error(rates),
            "latency_p50_ms": float(np.percentile(latency, 50)) if latency.size else 0.0,
            "latency_p99_ms": float(np.percentile(latency, 99)) if latency.size else 0.0,
        }


def observation_unit(call: CallOutcome) -> str:
    """What one observation of acceptance is: the caller when authenticated (each owner one
    weight, however many sessions it opens: one credential cannot outweigh the others), else
    the session (an open ingress cannot tell its callers apart)."""
    if call.owner:
        return "o:" + hashlib.sha256(call.owner.encode()).hexdigest()[:16]
    return call.session_id


def session_standard_error(rates: np.ndarray) -> float:
    """Standard error of the mean of per-session acceptances: sample sd / sqrt(sessions).

    Below two sessions the spread is unknown; a rate in [0, 1] has sd <= 0.5, so the
    bound 0.5 / sqrt(n) stands in (the widest the noise can be).
    """
    if rates.size < 2:
        return 0.5 / math.sqrt(max(1, rates.size))
    return float(rates.std(ddof=1) / math.sqrt(rates.size))


def _percentiles_ms(seconds: deque[float]) -> dict[str, float]:
    """p50 and p99 of `seconds`, in ms (zeros when empty)."""
    if not seconds:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    values = np.asarray(seconds, dtype=float) * 1e3
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99))}


@dataclass
class ReplicaFigures:
    """What the ingress saw of one replica: calls, sessions opened there, verify and stream latency.

    These are the per-replica figures a policy is judged by: how much of the load a
    slow replica got, and how much slower each of its calls and streamed tokens were.
    """

    calls: int = 0
    sessions: int = 0  # sessions opened (or reopened) on this replica
    tokens: int = 0  # target tokens routed here (prompts, drafts, Generate budgets)
    verify: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    stream_token: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    def record(self, method: str, seconds: float, tokens: int, opened: bool, streamed: int) -> None:
        """Count one finished call (`streamed`: tokens a stream delivered)."""
        self.calls += 1
        self.sessions += opened
        self.tokens += tokens
        if method == "Verify":
            self.verify.append(seconds)
        elif streamed > 0:
            self.stream_token.append(seconds / streamed)

    def summary(self) -> dict[str, Any]:
        """Counts and latency percentiles (Verify round trip; seconds per streamed token)."""
        return {
            "calls": self.calls,
            "sessions": self.sessions,
            "tokens": self.tokens,
            "verify": _percentiles_ms(self.verify),
            "stream_token": _percentiles_ms(self.stream_token),
        }
