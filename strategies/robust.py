"""Robust aggregation and per-client bounds, for rounds where the server sees each contribution.

Plain (non-SecAgg) rounds can defend against malicious clients in three layers:

1. :func:`apply_bounds` — the server's bounds on ONE contribution: its self-reported
   weight is capped at ``max_weight`` (the delta is rescaled with it, so the client's
   update is unchanged and only its say shrinks), and a contribution whose update
   norm ``||delta / weight||`` (plus its ``ctrl/`` part) exceeds ``max_update_norm``
   is refused with a reason. One mechanism, usable wherever contributions are seen.
2. :func:`adaptive_bounds` — the default defence, on with no option set: each weight is
   capped at ``weight_multiple`` x the round's median weight (the delta rescaled with it),
   and an update whose norm is above ``norm_multiple`` x the round's median update norm is
   refused with a reason. Honest clients of one round run the same steps and learning rate,
   so their norms sit within a small factor of each other and a clean round keeps every
   client; a client that scales its update (x(-50)) or its weight (x1e6) is cut back to at
   most a median client's say. It needs an honest majority of the round (3 or more clients).
3. :func:`robust_sum` — the round's combination rule. ``mean`` is the exact weighted
   sum (:func:`~fedge.strategies.contract.sum_contributions`); ``median`` (Yin et al. 2018),
   ``trimmed-mean`` (same paper) and ``krum`` (Blanchard et al. 2017) combine the
   per-client UNSCALED updates ``delta / weight`` with equal say (a self-reported weight
   is what an attacker controls) using Flower's own functions where Flower has them
   (``trim_mean``, ``select_multikrum``). The result is written back in the shape of a
   sum (weight = number of contributing clients, delta = that number times the robust
   update), so every strategy's ``finalize`` and server optimizer apply unchanged.

Under SecAgg+ only the sum exists, so the same bounds split in two halves: each honest
client clips its own weight and update before masking (:func:`clip_contribution`), and
the server checks that the sum could be one of that many clipped contributions
(:func:`aggregate_problem`); the robust rules cannot run there (see the privacy docs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

from fedge import keys
from fedge.errors import FedgeError
from fedge.strategies.contract import sum_contributions
from fedge.types import Arrays

log = logging.getLogger(__name__)

AGGREGATION_RULES = ("mean", "median", "trimmed-mean", "krum")
DEFAULT_NORM_MULTIPLE = 3.0  # refuse an update above 3x the round's median update norm
DEFAULT_WEIGHT_MULTIPLE = 3.0  # cap a weight at 3x the round's median weight


class RuleTooSmall(FedgeError):
    """A robust rule is sized so it cannot remove what it is meant to (strict mode refuses it)."""


@dataclass(frozen=True)
class RobustConfig:
    """The combination rule and the per-client bounds; 0 switches a bound off."""

    rule: str = "mean"
    trim_beta: float = 0.2  # trimmed mean: fraction cut from EACH tail (Flower's default)
    krum_malicious: int = 0  # Krum's f, the attackers it must tolerate (n - f - 2 neighbours)
    max_weight: float = 0.0  # cap on a client's meta/weight (e.g. its true example count bound)
    max_update_norm: float = 0.0  # refuse a client whose ||delta/weight|| exceeds this
    norm_multiple: float = DEFAULT_NORM_MULTIPLE  # refuse above this x median norm (0: off)
    weight_multiple: float = DEFAULT_WEIGHT_MULTIPLE  # cap at this x median weight (0: off)
    strict: bool = False  # refuse (not only warn about) a rule too small for its round

    def __post_init__(self) -> None:
        """Refuse unknown rules and impossible bounds, naming the config key."""
        if self.rule not in AGGREGATION_RULES:
            raise ValueError(
                f"aggregation rule must be one of {', '.join(AGGREGATION_RULES)}, got {self.rule!r}"
            )
        if not 0.0 <= self.trim_beta < 0.5:
            raise ValueError(f"trimmed-mean-beta must be in [0, 0.5), got {self.trim_beta}")
        if self.krum_malicious < 0:
            raise ValueError(f"krum-malicious must be >= 0, got {self.krum_malicious}")
        if self.max_weight < 0 or self.max_update_norm < 0:
            raise ValueError(
                "max-client-weight and max-update-norm must be >= 0 (0: no bound), got "
                f"{self.max_weight} and {self.max_update_norm}"
            )
        for key, value in (
            ("norm-bound-multiple", self.norm_multiple),
            ("weight-cap-multiple", self.weight_multiple),
        ):
            if not (value == 0 or value >= 1) or not np.isfinite(value):
                raise ValueError(f"{key} must be 0 (off) or >= 1, got {value}")


def update_norm(contribution: Arrays) -> float:
    """L2 norm of the client's unscaled update: delta/weight and its ctrl/ part jointly."""
    weight = float(contribution[keys.KEY_WEIGHT][0])
    scale = 1.0 / weight if weight > 0 else 0.0
    delta = control = 0.0
    for k, v in contribution.items():
        if k.startswith((keys.PREFIX_DELTA, keys.PREFIX_CONTROL)):
            flat = v.astype(np.float64).reshape(-1)  # one float64 copy, one dot: no temporaries
            squares = float(flat @ flat)
            if k.startswith(keys.PREFIX_DELTA):
                delta += squares
            else:
                control += squares
    return float(np.sqrt(delta * scale * scale + control))


def apply_bounds(contribution: Arrays, cfg: RobustConfig) -> tuple[Arrays, str | None]:
    """Return (the contribution with its weight capped, None) or (it, why it is refused).

    Always refused, bounds or not: a negative ``meta/weight`` (it would subtract the
    client's update from the others') and a ``meta/count`` other than 0 or 1.
    """
    weight, count = float(contribution[keys.KEY_WEIGHT][0]), float(contribution[keys.KEY_COUNT][0])
    if weight < 0 or count not in (0.0, 1.0):
        return contribution, f"meta/weight {weight:g} or meta/count {count:g} is impossible"
    if cfg.max_update_norm > 0:
        norm = update_norm(contribution)
        if norm > cfg.max_update_norm:
            return contribution, (
                f"update norm {norm:.4g} exceeds max-update-norm={cfg.max_update_norm:g}"
            )
    return cap_weight(contribution, cfg.max_weight), None


def cap_weight(contribution: Arrays, max_weight: float) -> Arrays:
    """The contribution with its weight capped at ``max_weight`` (0: none) and its delta
    rescaled with it, so the update is unchanged and only its say shrinks."""
    weight = float(contribution[keys.KEY_WEIGHT][0])
    if not (max_weight > 0 and weight > max_weight):
        return contribution
    ratio = np.float32(max_weight / weight)
    capped = {
        k: (v * ratio if k.startswith(keys.PREFIX_DELTA) else v) for k, v in contribution.items()
    }
    capped[keys.KEY_WEIGHT] = np.array([max_weight], np.float32)
    return capped


def adaptive_bounds(
    contributions: list[Arrays], cfg: RobustConfig
) -> tuple[list[Arrays], dict[int, str]]:
    """The default defence over one round's contributions (already through :func:`apply_bounds`).

    Returns the kept contributions, weights capped at ``weight_multiple`` x the median weight
    (delta rescaled, so only the say shrinks), and ``{index: reason}`` for those refused
    because their update norm is above ``norm_multiple`` x the median update norm. Only live
    contributions (count 1, weight > 0) set the medians; fewer than 3 of them leave the round
    as it is (a median of two is their mean: an attacker's own norm would set the bound).
    """
    live = [
        i
        for i, c in enumerate(contributions)
        if float(c[keys.KEY_COUNT][0]) > 0 and float(c[keys.KEY_WEIGHT][0]) > 0
    ]
    if len(live) < 3 or not (cfg.norm_multiple > 0 or cfg.weight_multiple > 0):
        return list(contributions), {}
    refused: dict[int, str] = {}
    if cfg.norm_multiple > 0:
        norms = {i: update_norm(contributions[i]) for i in live}
        bound = cfg.norm_multiple * float(np.median(list(norms.values())))
        refused = {
            i: (
                f"update norm {n:.4g} exceeds norm-bound-multiple={cfg.norm_multiple:g} x the "
                f"round's median update norm ({bound:.4g})"
            )
            for i, n in norms.items()
            if not n <= bound
        }
    kept_live = [i for i in live if i not in refused]
    cap = 0.0
    if cfg.weight_multiple > 0 and kept_live:
        weights = [float(contributions[i][keys.KEY_WEIGHT][0]) for i in kept_live]
        cap = cfg.weight_multiple * float(np.median(weights))
    kept = [cap_weight(c, cap) for i, c in enumerate(contributions) if i not in refused]
    return kept, refused


def sizing_problem(rule: str, clients: int, cfg: RobustConfig) -> str | None:
    """Why ``rule`` over ``clients`` contributions cannot remove an attacker (None if it can).

    Trimmed mean cuts floor(beta x n) per tail: nothing when beta x n < 1. Krum needs
    n > 2f + 2 (Blanchard et al. 2017) to score each update against n - f - 2 neighbours.
    """
    if rule == "trimmed-mean" and cfg.trim_beta * clients < 1:
        return (
            f"trimmed-mean-beta={cfg.trim_beta:g} x {clients} clients < 1: the trimmed mean cuts "
            "nothing from either tail and is the plain mean; raise trimmed-mean-beta to at least "
            f"{1 / clients:.3g} or sample more clients"
        )
    if rule == "krum" and clients <= 2 * cfg.krum_malicious + 2:
        return (
            f"krum over {clients} clients with krum-malicious={cfg.krum_malicious}: Krum needs "
            f"more than 2f + 2 = {2 * cfg.krum_malicious + 2} clients to outvote f attackers"
        )
    return None


_warned_sizes: set[str] = set()


def check_sizing(clients: int, cfg: RobustConfig) -> None:
    """Warn once per distinct problem when the rule is too small for its round; refuse it in
    strict mode (:class:`RuleTooSmall`)."""
    problem = sizing_problem(cfg.rule, clients, cfg)
    if problem is None:
        return
    if cfg.strict:
        raise RuleTooSmall(f"{problem} (robust-strict refuses the round)")
    if problem not in _warned_sizes:
        _warned_sizes.add(problem)
        log.warning("%s", problem)


def clip_contribution(contribution: Arrays, cfg: RobustConfig) -> Arrays:
    """The honest client's half under SecAgg+ (the server sees only the sum): cap its own
    weight, then scale its update (``delta/weight`` and ``ctrl/`` jointly) to at most
    ``max_update_norm``, so its share of the sum is within :func:`aggregate_problem`'s bound."""
    capped = cap_weight(contribution, cfg.max_weight)
    if not cfg.max_update_norm > 0:  # no bound: the norm is not needed
        return capped
    norm = update_norm(capped)
    if not norm > cfg.max_update_norm:
        return capped
    factor = np.float32(cfg.max_update_norm / norm * (1 - 1e-6))  # float32 rounding stays below
    return {
        k: (v * factor if k.startswith((keys.PREFIX_DELTA, keys.PREFIX_CONTROL)) else v)
        for k, v in capped.items()
    }


def aggregate_problem(
    summed: Arrays, contributors: int, cfg: RobustConfig, slack: float = 0.0
) -> str | None:
    """Why a sum of ``contributors`` clipped contributions cannot be one (None when it can).

    The server's half under SecAgg+, where only the sum exists. With each client's weight
    w_i <= W and update ||delta_i / w_i|| <= U (plus ctrl/, jointly): the summed weight is
    in [0, n W], the summed count in [0, n], ||sum delta|| <= (sum w_i) U and
    ||sum ctrl|| <= n U. ``slack`` is the quantization error the sum may carry (per value
    for the weight, in norm for the arrays). It bounds the aggregate, not who broke it.
    """
    n = float(contributors)
    weight = float(summed[keys.KEY_WEIGHT][0])
    count = float(summed[keys.KEY_COUNT][0])
    if not (-slack <= weight and -0.5 <= count <= n + 0.5):
        return f"summed meta/weight {weight:.6g} or meta/count {count:.6g} of {contributors} clients is impossible"
    if cfg.max_weight > 0 and weight > n * cfg.max_weight + slack:
        return (
            f"summed meta/weight {weight:.6g} exceeds {contributors} clients x "
            f"max-client-weight={cfg.max_weight:g}"
        )
    if cfg.max_update_norm > 0:
        delta = _norm(summed, keys.PREFIX_DELTA)
        ctrl = _norm(summed, keys.PREFIX_CONTROL)
        if delta > max(weight, 0.0) * cfg.max_update_norm + slack or (
            ctrl > n * cfg.max_update_norm + slack
        ):
            return (
                f"summed update norm {delta:.6g} (ctrl {ctrl:.6g}) exceeds the bound of "
                f"{contributors} clients: summed weight {weight:.6g} x max-update-norm="
                f"{cfg.max_update_norm:g}"
            )
    return None


def _norm(arrays: Arrays, prefix: str) -> float:
    """L2 norm of every array under ``prefix``, jointly."""
    return float(
        np.sqrt(
            sum(
                float(np.sum(v.astype(np.float64) ** 2))
                for k, v in arrays.items()
                if k.startswith(prefix)
            )
        )
    )


def robust_sum(contributions: list[Arrays], cfg: RobustConfig) -> Arrays:
    """Combine one round's contributions by ``cfg.rule``, in the shape of their sum."""
    if cfg.rule == "mean":
        return sum_contributions(contributions)
    if not contributions:
        raise ValueError("robust_sum got no contributions: at least one client must reply")
    live = [
        c
        for c in contributions
        if float(c[keys.KEY_COUNT][0]) > 0 and float(c[keys.KEY_WEIGHT][0]) > 0
    ]
    if not live:  # every client's work was dropped: the plain sum says so (weight 0)
        return sum_contributions(contributions)
    check_sizing(len(live), cfg)
    updates = [_unscaled(c) for c in live]
    names = [k for k in updates[0] if not k.startswith(keys.PREFIX_META)]
    if cfg.rule == "krum":
        chosen = _krum(updates, names, cfg.krum_malicious)
        combined = {k: chosen[k].astype(np.float64) for k in names}
    else:
        combined = {k: _coordinatewise(np.stack([u[k] for u in updates]), cfg) for k in names}
    n = float(len(live))
    out: Arrays = {k: (v * n).astype(np.float32) for k, v in combined.items()}
    out[keys.KEY_WEIGHT] = np.array([n], np.float32)
    out[keys.KEY_COUNT] = np.array([n], np.float32)
    return out


def _unscaled(contribution: Arrays) -> Arrays:
    """The client's own update: delta/weight (the rest unchanged)."""
    weight = float(contribution[keys.KEY_WEIGHT][0])
    return {
        k: (v.astype(np.float64) / weight if k.startswith(keys.PREFIX_DELTA) else v)
        for k, v in contribution.items()
    }


def _coordinatewise(stacked: np.ndarray, cfg: RobustConfig) -> np.ndarray:
    """Median or Flower's trimmed mean along the client axis."""
    if cfg.rule == "median":
        return np.asarray(np.median(stacked, axis=0))
    return np.asarray(trim_mean(stacked, cfg.trim_beta))


def _krum(updates: list[Arrays], names: list[str], malicious: int) -> Arrays:
    """The one update Flower's Krum selects (closest to its n - f - 2 nearest neighbours)."""
    records = [
        RecordDict({"u": ArrayRecord({k: Array(np.ascontiguousarray(u[k])) for k in names})})
        for u in updates
    ]
    chosen = select_multikrum(records, num_malicious_nodes=malicious, num_nodes_to_select=1)[0]
    return updates[next(i for i, r in enumerate(records) if r is chosen)]


def krum_select(contributions: list[Arrays], malicious: int) -> int:
    """The index of the contribution Krum selects (the rule ``robust_sum`` applies for ``krum``),
    over contributions that each hold an update (``meta/count`` and ``meta/weight`` > 0)."""
    updates = [_unscaled(c) for c in contributions]
    names = [k for k in updates[0] if not k.startswith(keys.PREFIX_META)]
    chosen = _krum(updates, names, malicious)
    return next(i for i, u in enumerate(updates) if u is chosen)
