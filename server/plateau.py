"""The plateau stop: end a run once the participants' held-out perplexity stops improving.

``plateau-patience = P`` (0: off) stops the run after round t when none of rounds t-P+1..t
brought the participants' held-out perplexity below ``(1 - plateau-min-improvement)`` times
the best value of rounds 0..t-P: P rounds in a row without a real improvement. The rule is
evaluated after every round (its row and checkpoint written first), so the run ends with the
rounds actually trained, and a privacy budget has accounted for exactly those releases. The
run keeps its last adapter, not its best one: the figure reported is the last round's.

The stop reads held-out data, so when the run stopped is itself a data-dependent choice
that no accountant here prices; it is a bench device for "until perplexity stops improving"
(bench/private_population.py), and the epsilon reported is that of the rounds released.
"""

from __future__ import annotations

from collections.abc import Sequence


def plateaued(curve: Sequence[float | None], patience: int, min_improvement: float) -> bool:
    """Whether the last ``patience`` values of ``curve`` (round 0 first; None: not evaluated,
    skipped) all failed to beat the best earlier value by the relative ``min_improvement``."""
    values = [v for v in curve if v is not None]
    if patience <= 0 or len(values) <= patience:
        return False
    best_before = min(values[:-patience])
    return min(values[-patience:]) > best_before * (1.0 - min_improvement)
