"""Differential-privacy settings of a run, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fedge.privacy.accounting import METHODS, Method

DPMode = Literal["central", "distributed"]


@dataclass(frozen=True)
class DPConfig:
    """User-level DP of one federation (DP-FedAvg, McMahan et al. 2018, arXiv:1710.06963).

    Each client's update is clipped to L2 norm ``clip_norm`` (C); the round's sum carries
    Gaussian noise of std ``noise_multiplier * C`` (z C). ``central``: the server clips and
    noises. ``distributed``: every client clips and adds N(0, (z C)^2 / m), with m the least
    number of clients a round may finish with, under SecAgg+ so the server sees only the sum.
    """

    mode: DPMode = "central"
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    target_delta: float = 1e-5
    max_epsilon: float = 0.0  # 0 disables the budget stop
    # Every round is accounted as one full Gaussian release, no amplification by sampling:
    # the round loop samples with a seeded generator the server knows.
    accountant: Method = "rdp"  # "pld" is tighter (dp-accounting's privacy loss distributions)
    min_survival: float = 0.8  # distributed: a round needs this fraction of its clients

    def __post_init__(self) -> None:
        """Reject settings that break the mechanism or the accounting, naming the field."""
        if self.mode not in ("central", "distributed"):
            raise ValueError(f"dp mode={self.mode!r}: use 'central' or 'distributed'")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"clip_norm={self.clip_norm}: must be positive and finite")
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise_multiplier={self.noise_multiplier}: must be positive")
        if not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta={self.target_delta}: must be in (0, 1)")
        if self.max_epsilon < 0:
            raise ValueError(f"max_epsilon={self.max_epsilon}: must be >= 0 (0 disables it)")
        if self.accountant not in METHODS:
            raise ValueError(f"accountant={self.accountant!r}: use one of {', '.join(METHODS)}")
        if not 0 < self.min_survival <= 1:
            raise ValueError(f"min_survival={self.min_survival}: must be in (0, 1]")

    def min_clients(self, sampled: int) -> int:
        """Least number of contributors a distributed-DP round over ``sampled`` clients accepts."""
        return max(1, math.ceil(self.min_survival * sampled))

    def client_noise_std(self, sampled: int) -> float:
        """Noise std each client adds in distributed mode, so any accepted sum has std >= z C."""
        return self.noise_multiplier * self.clip_norm / math.sqrt(self.min_clients(sampled))
