"""The ServerApp: Flower's quickstart loop; the strategy line picks Flower's FedAvg or fedge's
SCAFFOLD, with or without fedge's SecAgg+."""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from fedge.server.secagg.strategy import SecAggPlus
from fedge.strategies.scaffold import Scaffold
from flowerapp.task import Net

app = ServerApp()


def make_strategy(name: str, num_nodes: int) -> Strategy:
    """The one line that differs: Flower's FedAvg or fedge's SCAFFOLD, bare or under fedge's
    SecAgg+ (same sampling knobs)."""
    if name == "scaffold":
        return Scaffold(min_train_nodes=num_nodes, min_available_nodes=num_nodes)
    if name == "scaffold-secagg":
        return SecAggPlus(Scaffold(min_train_nodes=num_nodes, min_available_nodes=num_nodes))
    return FedAvg(min_train_nodes=num_nodes, min_available_nodes=num_nodes)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured rounds and save the final model (``final-model``, a .pt file)."""
    cfg = context.run_config
    num_nodes = int(cfg.get("num-nodes", 4))
    strategy = make_strategy(str(cfg.get("strategy", "fedavg")), num_nodes)
    torch.manual_seed(int(cfg.get("seed", 0)))
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(cfg.get("num-server-rounds", 3)),
        train_config=ConfigRecord(),
    )
    out = Path(str(cfg.get("final-model", "final_model.pt")))
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result.arrays.to_torch_state_dict(), out)
