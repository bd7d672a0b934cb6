"""The ServerApp: Flower's `strategy.start`, with fedge's SCAFFOLD wrapped in fedge's SecAgg+."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedge.server.secagg.strategy import SecAggPlus, rejected_rounds_limit
from fedge.strategies.scaffold import Scaffold
from scaffoldsecagg.task import make_net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the rounds; the server only ever sees the sum of the masked contributions."""
    cfg = context.run_config
    nodes = int(cfg["num-nodes"])
    strategy = SecAggPlus(  # stops after max-rejected-rounds sums that broke the bounds
        Scaffold(min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0),
        max_rejected_rounds=rejected_rounds_limit(cfg),
    )
    torch.manual_seed(0)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_net().state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=ConfigRecord(),
    )
    torch.save(result.arrays.to_torch_state_dict(), str(cfg["final-model"]))
