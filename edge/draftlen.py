"""Draft length from an objective: the length that maximises expected accepted tokens per second.

One draft-and-verify round of draft length g costs

    T(g) = g * t_draft + c0 + c1 * g          (drafting, then one verify call)

where c0 is the verify call's fixed cost (network round trip plus one target pass) and c1 what
each extra drafted token adds to it (bytes and the verifier's extra compute). It yields

    E(a, g) = (1 - a^(g+1)) / (1 - a)          (Leviathan et al. 2023, i.i.d. acceptance a)

tokens, so the rate is R(g) = E(a, g) / T(g). When c0 dominates (a 100 ms round trip against a
1 ms draft step) R keeps rising until a^g is small, so drafts grow long; on a fast link with a
slow draft, short drafts win. Near its peak R is flat, while the verifies per token (1/E, the
cloud's cost) keep falling with g, so the estimator drafts the longest g within 2% of the best
R. `SpeculationEstimator` learns t_draft, c0, c1 and a online, one verify at a time, with
exponential forgetting, and answers `best_draft_len(lo, hi)`.

The network round trip is part of c0 but changes on its own (a phone moves from Wi-Fi to LTE):
the estimator is told the current RTT (`observe_rtt`, from a health check or the edge's recent
calls) and learns only what a call costs beyond it, so c0 = RTT + that learnt part moves with
the network at once instead of after ~10 verifies, and the draft length with it. The router
asks the same model what speculative decoding would yield at another RTT (`seconds_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedge.edge.speculative import expected_tokens_per_pass

MAX_POSITIONS = 32  # draft positions with their own acceptance estimate (the verifier caps k lower)


def round_seconds(g: int, draft_step_s: float, call_s: float, call_per_token_s: float) -> float:
    """Wall time of one round: g draft steps, then a verify call costing c0 + c1 * g."""
    return g * draft_step_s + call_s + call_per_token_s * g


def tokens_per_second(
    g: int, acceptance: float, draft_step_s: float, call_s: float, call_per_token_s: float = 0.0
) -> float:
    """Expected committed tokens per second at draft length g: E(a, g) / T(g)."""
    seconds = round_seconds(g, draft_step_s, call_s, call_per_token_s)
    if seconds <= 0:
        raise ValueError(f"a round must take time; got T({g}) = {seconds} s")
    return expected_tokens_per_pass(acceptance, g) / seconds


def best_draft_len(
    acceptance: float,
    draft_step_s: float,
    call_s: float,
    call_per_token_s: float = 0.0,
    lo: int = 1,
    hi: int = 16,
) -> int:
    """The g in [lo, hi] with the highest expected tokens per second (the shortest on ties)."""
    if not 0 <= lo <= hi:
        raise ValueError(f"best_draft_len needs 0 <= lo <= hi, got lo={lo}, hi={hi}")
    rates = {
        g: tokens_per_second(g, acceptance, draft_step_s, call_s, call_per_token_s)
        for g in range(lo, hi + 1)
    }
    return max(rates, key=lambda g: (rates[g], -g))


@dataclass(frozen=True)
class EstimatorConfig:
    """Priors and forgetting of the online estimates."""

    decay: float = 0.9  # weight kept by past verifies at each new one (about 10 verifies of memory)
    prior_acceptance: float = 0.6  # before any verify: a typical distilled draft
    prior_trials: float = 4.0  # weight of that prior, in drafted-token trials
    prior_draft_step_s: float = 0.002
    prior_call_s: float = 0.01
    slope_ridge: float = 4.0  # tokens^2 added to the draft lengths' variance when fitting c1
    # the longest draft within this share of the best rate: fewer verifies (the cloud's cost) for
    # at most 2% of speed; near its peak the rate curve is flat, so this saves verifies cheaply
    rate_slack: float = 0.02

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"EstimatorConfig.decay must lie in (0, 1], got {self.decay}")
        if not 0.0 <= self.prior_acceptance < 1.0:
            raise ValueError(
                f"EstimatorConfig.prior_acceptance must lie in [0, 1), got {self.prior_acceptance}"
            )
        if not 0.0 <= self.rate_slack < 1.0:
            raise ValueError(
                f"EstimatorConfig.rate_slack must lie in [0, 1), got {self.rate_slack}"
            )
        for name in ("prior_trials", "prior_draft_step_s", "prior_call_s", "slope_ridge"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EstimatorConfig.{name} must be > 0, got {getattr(self, name)}")


class SpeculationEstimator:
    """Online estimates of acceptance, draft step time and verify call cost, updated per verify.

    Acceptance is the maximum-likelihood rate of a truncated geometric: each round adds its
    accepted tokens as successes and one failure if the target rejected a drafted token
    (accepted/drafted would count the tokens after a rejection, never tried, as failures).
    Acceptance is also kept per draft position (the chance that token i is accepted when tokens
    before it were), shrunk towards the pooled rate: a draft that agrees in runs has rising
    conditional acceptance, so the i.i.d. E(a, g) would undervalue long drafts; `expected_tokens`
    uses the per-position rates. The call cost is a decayed ridge-regression line c0 + c1 * g
    over the draft lengths seen (the ridge keeps noise in a few calls from inventing a per-token
    cost that would shorten drafts).
    """

    def __init__(self, config: EstimatorConfig | None = None) -> None:
        self.config = config or EstimatorConfig()
        c = self.config
        self._successes = c.prior_acceptance * c.prior_trials
        self._failures = (1 - c.prior_acceptance) * c.prior_trials
        self._steps = 0.0  # decayed drafted tokens and their seconds
        self._step_seconds = 0.0
        self._n = self._sg = self._sc = self._sgg = self._sgc = 0.0  # sums for the call-cost line
        self._tried = [0.0] * MAX_POSITIONS  # decayed trials and successes per draft position
        self._kept = [0.0] * MAX_POSITIONS
        self.verifies = 0
        self.rtt_s = 0.0  # the network round trip now; calls are learnt net of it

    def observe_rtt(self, seconds: float) -> None:
        """The network round trip now (0 when unknown): part of every call from here on."""
        if not seconds >= 0:
            raise ValueError(f"a round trip must be >= 0 s, got {seconds}")
        self.rtt_s = seconds

    # ---- updates ------------------------------------------------------------------------------
    def observe(
        self, drafted: int, accepted: int, draft_seconds: float, call_seconds: float
    ) -> None:
        """One verify: k drafted, `accepted` kept, time spent drafting and waiting on the call."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted} of {drafted}")
        if draft_seconds < 0 or call_seconds < 0:
            raise ValueError(f"times must be >= 0, got {draft_seconds}, {call_seconds}")
        d = self.config.decay
        self._successes = d * self._successes + accepted
        self._failures = d * self._failures + (1.0 if accepted < drafted else 0.0)
        for i in range(MAX_POSITIONS):  # position i was tried when every token before it was kept
            self._tried[i] = d * self._tried[i] + (1.0 if i <= accepted and i < drafted else 0.0)
            self._kept[i] = d * self._kept[i] + (1.0 if i < accepted else 0.0)
        if drafted:
            self._steps = d * self._steps + drafted
            self._step_seconds = d * self._step_seconds + draft_seconds
        g, beyond = float(drafted), call_seconds - self.rtt_s  # what the call cost beyond the RTT
        self._n = d * self._n + 1
        self._sg = d * self._sg + g
        self._sc = d * self._sc + beyond
        self._sgg = d * self._sgg + g * g
        self._sgc = d * self._sgc + g * beyond
        self.verifies += 1

    # ---- estimates ----------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        """Per-token acceptance a (kept below 1 so E stays finite)."""
        return min(0.99, self._successes / (self._successes + self._failures))

    def acceptance_at(self, position: int) -> float:
        """Chance that draft token `position` (0-based) is kept when all before it were."""
        pooled, w = self.acceptance, self.config.prior_trials
        if position >= MAX_POSITIONS:
            return pooled
        return min(0.99, (self._kept[position] + w * pooled) / (self._tried[position] + w))

    def expected_tokens(self, g: int) -> float:
        """Expected tokens per verify at draft length g: 1 + sum_j prod_{i<j} a_i."""
        total, run = 1.0, 1.0
        for i in range(g):
            run *= self.acceptance_at(i)
            total += run
        return total

    @property
    def draft_step_s(self) -> float:
        """Seconds per drafted token."""
        if self._steps <= 0:
            return self.config.prior_draft_step_s
        return self._step_seconds / self._steps

    @property
    def call_line(self) -> tuple[float, float]:
        """(c0, c1): the verify call's fixed seconds and seconds per drafted token (c1 >= 0)."""
        return self.call_line_at(self.rtt_s)

    def call_line_at(self, rtt_s: float) -> tuple[float, float]:
        """(c0, c1) at round trip `rtt_s`: c0 = rtt_s + the learnt cost beyond the network."""
        if self._n <= 0:
            return rtt_s + self.config.prior_call_s, 0.0
        mean_g, mean_c = self._sg / self._n, self._sc / self._n
        var = self._sgg / self._n - mean_g * mean_g
        cov = self._sgc / self._n - mean_g * mean_c
        # ridge towards 0: a verify pass costs about the same for any k here (bench/edge.py measures
        # it), so a slope must be supported by lengths that varied, not by noise in a few calls
        slope = max(0.0, cov / (var + self.config.slope_ridge))
        return max(0.0, rtt_s + mean_c - slope * mean_g), slope

    def rate(self, g: int, rtt_s: float | None = None) -> float:
        """Expected tokens per second at draft length g (at round trip `rtt_s`, default now)."""
        c0, c1 = self.call_line_at(self.rtt_s if rtt_s is None else rtt_s)
        return self.expected_tokens(g) / round_seconds(g, self.draft_step_s, max(c0, 1e-6), c1)

    def best_draft_len(self, lo: int, hi: int, rtt_s: float | None = None) -> int:
        """The longest draft length in [lo, hi] whose expected tokens per second (at `rtt_s`) is
        within `rate_slack` of the best: each token then costs the cloud the fewest verifies."""
        if not 0 <= lo <= hi:
            raise ValueError(f"best_draft_len needs 0 <= lo <= hi, got lo={lo}, hi={hi}")
        rates = {g: self.rate(g, rtt_s) for g in range(lo, hi + 1)}
        floor = (1.0 - self.config.rate_slack) * max(rates.values())
        return max(g for g, rate in rates.items() if rate >= floor)

    def seconds_per_token(self, lo: int, hi: int, rtt_s: float) -> float:
        """Expected seconds per committed token at round trip `rtt_s`, drafting the best length."""
        return 1.0 / self.rate(self.best_draft_len(lo, hi, rtt_s), rtt_s)
