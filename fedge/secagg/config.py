"""SecAgg+ protocol settings, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge import keys

# Most neighbours a client accepts (the neighbourhood, self excluded). Clients refuse more,
# the server never forms more, and tests/privacy/adversary enumerates the unmask rule against
# every neighbourhood size up to it and every threshold. The default graph,
# 2 ceil(log2 n) + 1 neighbours-plus-self, stays below it up to 2^31 clients.
MAX_NEIGHBOURS = 64

# With example weighting delta/ and meta/weight grow with a client's example count; this
# divisor (the largest count expected) brings them into the clipping range before quantizing.
DEFAULT_MAX_WEIGHT = 1000.0


def weight_scales(
    weighting: str, max_weight: float = DEFAULT_MAX_WEIGHT
) -> tuple[tuple[str, float], ...]:
    """The ``key_scales`` a strategy's weighting needs: none for uniform, ``max_weight`` for examples."""
    if weighting != "examples":
        return ()
    return ((keys.PREFIX_DELTA, max_weight), (keys.KEY_WEIGHT, max_weight))


@dataclass(frozen=True)
class SecAggConfig:
    """Settings of one SecAgg+ aggregation (Bell et al. 2020, https://eprint.iacr.org/2020/704).

    Each client secret-shares its self-mask seed with its `num_shares - 1` graph
    neighbours (it keeps no share itself); `reconstruction_threshold` of those shares
    rebuild it, and it must be more than half of the neighbours (clients refuse less,
    docs/privacy.md says why). A round therefore tolerates up to
    `num_shares - 1 - threshold` drop-outs per neighbourhood after the key-sharing stage.
    """

    num_shares: int | float | None = (
        None  # None: 2*ceil(log2 n)+1 neighbours-plus-self, capped at n
    )
    reconstruction_threshold: int | float = 2 / 3  # fraction of the neighbours, > 1/2
    clipping_range: float = (
        8.0  # values are clipped to [-R, R] (after per-key scaling) before quantizing
    )
    quantization_range: int = (
        2**22
    )  # levels of the quantizer; error per value and client < 2R / this
    modulus_range: int = 2**32  # masks and sums live in Z_modulus; must be a power of two <= 2**32
    stage_timeout_s: float = 60.0  # every stage waits at most this long for replies
    min_contributors: int = 2  # fewer surviving masked inputs than this fail the round
    key_scales: tuple[
        tuple[str, float], ...
    ] = ()  # (key or "prefix/", divisor) applied before clipping

    def __post_init__(self) -> None:
        """Reject settings the protocol cannot run with, naming the field."""
        if isinstance(self.num_shares, float) and not 0 < self.num_shares <= 1:
            raise ValueError(f"num_shares={self.num_shares}: a float must be in (0, 1]")
        if isinstance(self.num_shares, int) and not 2 <= self.num_shares <= MAX_NEIGHBOURS + 1:
            raise ValueError(
                f"num_shares={self.num_shares}: need 2 to {MAX_NEIGHBOURS + 1} (neighbours plus "
                f"self; clients accept at most {MAX_NEIGHBOURS} neighbours)"
            )
        t = self.reconstruction_threshold
        if isinstance(t, float) and not 0.5 < t <= 1:
            raise ValueError(
                f"reconstruction_threshold={t}: a fraction must be in (0.5, 1]; at half or less "
                "a server could collect both secrets of a node"
            )
        if isinstance(t, int) and t < 1:
            raise ValueError(f"reconstruction_threshold={t}: need at least 1")
        if not (self.clipping_range > 0 and math.isfinite(self.clipping_range)):
            raise ValueError(f"clipping_range={self.clipping_range}: must be positive and finite")
        m = self.modulus_range
        if m <= 1 or m > 2**32 or m & (m - 1):
            raise ValueError(f"modulus_range={m}: must be a power of two in [2, 2**32]")
        if not 1 <= self.quantization_range < m:
            raise ValueError(
                f"quantization_range={self.quantization_range}: must be in [1, modulus_range)"
            )
        if self.stage_timeout_s <= 0:
            raise ValueError(f"stage_timeout_s={self.stage_timeout_s}: must be positive")
        if self.min_contributors < 1:
            raise ValueError(f"min_contributors={self.min_contributors}: need at least 1")
        for name, scale in self.key_scales:
            if not (scale > 0 and math.isfinite(scale)):
                raise ValueError(f"key_scales[{name!r}]={scale}: must be positive and finite")

    def shares_for(self, num_clients: int) -> int:
        """Return the neighbourhood size (self included) for `num_clients` sampled clients,
        at most ``MAX_NEIGHBOURS + 1`` (a fraction of many clients is capped there)."""
        if self.num_shares is None:
            k = 2 * math.ceil(math.log2(max(num_clients, 2))) + 1
        elif isinstance(self.num_shares, float):
            k = math.ceil(self.num_shares * num_clients)
        else:
            k = self.num_shares
        return max(2, min(k, num_clients, MAX_NEIGHBOURS + 1))

    def threshold_for(self, num_neighbours: int) -> int:
        """Return the number of neighbours' shares that rebuild a node's self-mask seed."""
        t = self.reconstruction_threshold
        k = min(math.ceil(t * num_neighbours) if isinstance(t, float) else t, num_neighbours)
        if 2 * k <= num_neighbours:
            raise ValueError(
                f"reconstruction_threshold={t} gives {k} of {num_neighbours} neighbours, not "
                "more than half: clients refuse it; raise secagg-threshold"
            )
        return k

    def check_capacity(self, num_clients: int) -> None:
        """Fail before a round whose quantized sum could wrap around the modulus."""
        if num_clients * self.quantization_range >= self.modulus_range:
            raise ValueError(
                f"{num_clients} clients x quantization_range={self.quantization_range} "
                f">= modulus_range={self.modulus_range}: the sum would overflow; lower "
                "quantization_range or sample fewer clients per round"
            )
