"""Wire keys of differential privacy: what DP aggregators send clients, and what clients report."""

from __future__ import annotations

from typing import Final

KEY_DP_CLIP: Final = "dp-clip-norm"  # float: L2 bound of one client's sensitive contribution
KEY_DP_NOISE_STD: Final = (
    "dp-noise-std"  # float: std of the noise each client adds (distributed DP)
)
DDP_CLIENT_MOD: Final = "distributed-dp"  # its name in the clients' fixed mod registry
KEY_DP_ACTIVE: Final = "dp-active"  # bool: a DP aggregator runs this round (turns FFA-LoRA on)
MET_DPSGD_EPSILON: Final = "dp-sgd-epsilon"  # metric: the client's DP-SGD epsilon spent so far
KEY_DP_MIN_CLIENTS: Final = "dp-min-clients"  # int: contributors a distributed-DP round needs
KEY_DPSGD_NOISE: Final = "dp-sgd-noise-multiplier"  # float > 0 turns DP-SGD on
KEY_DPSGD_CLIP: Final = "dp-sgd-max-grad-norm"  # float: DP-SGD's per-sample clip
KEY_DPSGD_DELTA: Final = "dp-sgd-delta"  # float: delta of the reported DP-SGD epsilon
KEY_ACCOUNTANT: Final = "dp-accountant"  # rdp | pld: how the server's epsilon is computed
# The training loss under DP: released noised and accounted, never in clear (issue 30).
KEY_DP_METRIC_CLIP: Final = (
    "dp-metric-clip"  # float: L, each loss clipped into [0, L]; 0: kept home
)
DEFAULT_METRIC_CLIP: Final = 12.0  # ln of a 50k-token vocabulary is 10.8: a guessing model fits
KEY_DP_METRIC_NOISE: Final = "dp-metric-noise-scale"  # float >= 1: the loss's noise is k x z's
DEFAULT_METRIC_NOISE_SCALE: Final = 3.0  # k = 3: the loss costs ~10% more epsilon, not ~90%
MET_DP_TRAIN_LOSS: Final = "dp-train-loss"  # metric: the training loss, DP-noised and accounted
REFUSAL_BUDGET: Final = "privacy budget exhausted"  # opens a client's refusal to overspend
