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
REFUSAL_BUDGET: Final = "privacy budget exhausted"  # opens a client's refusal to overspend
