"""The ServerApp: Flower's quickstart loop; one line picks central DP (fixed or adaptive clip),
distributed DP under SecAgg+, or plain FedAvg for clients that run DP-SGD."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from fedge.server.privacy.strategy import AdaptiveClip, CentralDP
from fedge.server.secagg.strategy import DistributedDP, SecAggPlus, rejected_rounds_limit
from fedge.strategies.fedavg import FedAvg
from flowerdp.task import Net

app = ServerApp()


def make_strategy(
    privacy: str, nodes: int, z: float, clip: float, max_eps: float, max_rejected: int
) -> Strategy:
    """The one line that differs per DP variant (evaluation is the server's, below)."""
    fedavg = FedAvg(min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0)
    if privacy == "central":
        return CentralDP(fedavg, noise_multiplier=z, clip=clip, max_epsilon=max_eps)
    if privacy == "central-adaptive":  # C follows the median update norm (Andrew et al. 2021)
        adaptive = AdaptiveClip(initial_norm=clip, count_stddev=1.0)
        return CentralDP(fedavg, noise_multiplier=z, clip=adaptive, max_epsilon=max_eps)
    if privacy == "distributed":  # clients clip and noise, SecAgg+ shows the server the sum
        dp = DistributedDP(z, clip_norm=clip, max_epsilon=max_eps)
        return SecAggPlus(fedavg, dp=dp, max_rejected_rounds=max_rejected)
    return fedavg  # "dp-sgd": the clients' own loops are private


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the rounds; save the final model and every round's train metrics (epsilon included)."""
    cfg = context.run_config
    strategy = make_strategy(str(cfg["privacy"]), int(cfg["num-nodes"]),
                             float(cfg["noise-multiplier"]), float(cfg["clip"]),
                             float(cfg["max-epsilon"]), rejected_rounds_limit(cfg))  # fmt: skip
    torch.manual_seed(int(cfg["seed"]))
    rounds = int(cfg["num-server-rounds"])
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=rounds
    )
    out = Path(str(cfg["out-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result.arrays.to_torch_state_dict(), out / "final_model.pt")
    metrics = {
        r: dict(m) for r, m in result.train_metrics_clientapp.items()
    }  # "dp-epsilon" per round
    (out / "train_metrics.json").write_text(json.dumps(metrics, indent=1))
