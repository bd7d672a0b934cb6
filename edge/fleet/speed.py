"""How fast a verifier replica serves: seconds per token of work, per kind of call (Ray-free).

Both sides measure it. A router (`fedge.edge.fleet.routers`) measures each replica from the
calls its own handle sent there; a replica (`fedge.edge.fleet.replica`) measures itself from
every call it serves, whichever ingress sent it, and reports that through Serve's routing
stats (`SPEEDS`), since only the replica sees its whole queue.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, NamedTuple, TypeVar

SPEED_SAMPLES = 15  # a replica's seconds per work token on a kind of call: median of its last calls
SPEED_MIN_SAMPLES = 5  # fewer calls of a kind say nothing yet (the first ones pay the warm-up)
SPEED_MAX_AGE_S = 60.0  # a speed not heard of for this long is forgotten and measured again
CALL_TOKENS = (
    32  # a call's fixed cost in token positions (pass + relay on an overhead-bound target)
)
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)  # a median's standard error over a mean's (normal)
K = TypeVar("K", bound=Hashable)  # what a speed is kept per: a kind, or (replica, kind)


class Speed(NamedTuple):
    """A measured speed and how far to trust it."""

    seconds: float  # median seconds per work token over the last calls
    log_se: float  # standard error of its logarithm (the calls' spread; 0 when they agree)


def call_kind(method: str, tokens: int) -> str:
    """Calls alike enough to compare replicas on: same method, tokens within a factor of two.

    A 100-token prefill costs far less per token than a one-token verify, so one
    seconds-per-token figure over a mix of calls swings with the mix, not the replica.
    """
    return f"{method}/{max(1, tokens).bit_length()}"


def work_tokens(pending_tokens: float, tokens: float) -> float:
    """The work a call waits through on a replica, in token positions: its queue and itself.

    Every call also pays `CALL_TOKENS` of fixed cost (a pass, the relay), which pending
    calls share with it in a batch: so an idle slow replica is not preferred to a fast one
    that holds a few short verifies, whose passes the new call joins.
    """
    return CALL_TOKENS + pending_tokens + tokens


class SpeedMeter(Generic[K]):
    """Seconds per work token per key: the median of the last `SPEED_SAMPLES` samples, robust
    to a warm-up call or a stall, once there are `SPEED_MIN_SAMPLES`.

    A key not heard of within `SPEED_MAX_AGE_S` is forgotten (one set by hand in `speed`
    never ages): a router can stop sending calls to a replica it measured slow, and without
    an age that replica stayed marked slow after it recovered. Forgotten, it counts as
    unmeasured and its next calls measure it again. A speed's noise (`Speed.log_se`, from
    its samples) lets a comparison tell a slower replica from a spread of calls.
    """

    def __init__(self) -> None:
        self.speed: dict[K, float] = {}  # median seconds per work token per key
        self._samples: dict[K, deque[float]] = {}
        self._measured_at: dict[K, float] = {}  # each key's last sample's time

    def record(self, key: K, seconds: float, work: float) -> None:
        """One call of `key` took `seconds` through `work` tokens (`work_tokens`)."""
        now = time.monotonic()
        if now - self._measured_at.get(key, now) > SPEED_MAX_AGE_S:
            self._samples.pop(key, None)  # samples of another time: measure afresh
            self.speed.pop(key, None)
        samples = self._samples.setdefault(key, deque(maxlen=SPEED_SAMPLES))
        samples.append(seconds / work)
        self._measured_at[key] = now
        if len(samples) >= SPEED_MIN_SAMPLES:
            self.speed[key] = statistics.median(samples)

    def current(self) -> dict[K, float]:
        """The speeds heard of within `SPEED_MAX_AGE_S`."""
        now = time.monotonic()
        return {
            key: seconds
            for key, seconds in self.speed.items()
            if now - self._measured_at.get(key, now) <= SPEED_MAX_AGE_S
        }

    def current_with_noise(self) -> dict[K, Speed]:
        """`current`, each speed with the standard error of its logarithm (from its samples,
        computed here rather than on every call)."""
        return {
            key: Speed(s, median_log_se(self._samples.get(key, ())))  # set by hand: no noise
            for key, s in self.current().items()
        }

    def keep(self, wanted: Callable[[K], bool]) -> None:
        """Forget every key but the `wanted` ones (e.g. a dead replica's)."""
        for key in [k for k in {*self.speed, *self._samples} if not wanted(k)]:
            self.speed.pop(key, None)
            self._samples.pop(key, None)
            self._measured_at.pop(key, None)


def median_log_se(samples: Iterable[float]) -> float:
    """The standard error of the median of `samples`' logarithms: their spread over the root
    of their count, times `MEDIAN_SE_FACTOR` (seconds per token are skewed; logs are not)."""
    logs = [math.log(max(s, 1e-12)) for s in samples]
    if len(logs) < 2:
        return 0.0
    return MEDIAN_SE_FACTOR * statistics.stdev(logs) / math.sqrt(len(logs))


class Ticket(NamedTuple):
    """A call a replica began: what it puts through, the work in flight ahead of it, when."""

    kind: str
    tokens: int
    ahead: int
    started: float


class ReplicaSpeed:
    """A replica's own speed per kind of call, measured behind every unary call its verifier
    is working on, whichever ingress sent it (a stream's time is paced by its reader as much
    as by the replica: it is not counted; a call answered but held back, `leave`, is late,
    not work ahead of the next).

    Each router sees only the calls its ingress sent: behind two ingresses, half a busy
    replica's queue was invisible to each, so its calls' time per token of the work a
    router saw ahead of them came out nearly twice its speed, and a replica slowed 4x
    measured 2.0x (median over a bench run; under 2x half the time) where the replica's
    own count gave 2.8x. Thread-safe: Serve reads the report from another thread than the
    replica's calls run on.
    """

    def __init__(self) -> None:
        self.pending_tokens = 0  # tokens of the calls in flight here, from every ingress
        self._meter: SpeedMeter[str] = SpeedMeter()
        self._lock = threading.Lock()

    def begin(self, method: str, tokens: int) -> Ticket:
        """A call of `method` putting `tokens` through the target arrived: it joins the queue."""
        with self._lock:
            ticket = Ticket(
                call_kind(method, tokens), tokens, self.pending_tokens, time.monotonic()
            )
            self.pending_tokens += tokens
            return ticket

    def leave(self, ticket: Ticket) -> None:
        """The verifier is done with the call (answered, failed or cancelled): it leaves the
        queue. What follows (the bench's slowed replica holding the answer back) is late, not
        work that later calls wait behind."""
        with self._lock:
            self.pending_tokens -= ticket.tokens

    def served(self, ticket: Ticket) -> None:
        """The call, out of the queue (`leave`), was answered: one sample of its kind, its whole
        time over the work it waited through. A refusal or a failure measures nothing."""
        with self._lock:
            seconds = time.monotonic() - ticket.started
            self._meter.record(ticket.kind, seconds, work_tokens(ticket.ahead, ticket.tokens))

    def report(self) -> dict[str, float]:
        """Seconds per work token per kind of call, as `SpeedMeter.current` gives them."""
        with self._lock:
            return self._meter.current()

    def report_with_noise(self) -> dict[str, Speed]:
        """`report`, each speed with its noise (`Speed.log_se`): what a rollout compares on."""
        with self._lock:
            return self._meter.current_with_noise()
