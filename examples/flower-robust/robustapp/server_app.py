"""The ServerApp: fedge's FedAvg with a robust rule sized for `attackers` of `num-nodes` clients."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedge.strategies.fedavg import FedAvg
from fedge.strategies.robust import RobustConfig
from robustapp.task import make_net

app = ServerApp()


def sized_rule(rule: str, nodes: int, attackers: int) -> RobustConfig:
    """Krum tolerates f attackers when n >= 2f + 3; the trimmed mean must cut at least f per tail."""
    if rule == "krum" and nodes >= 2 * attackers + 3:
        return RobustConfig(rule="krum", krum_malicious=attackers)
    if rule == "trimmed-mean" and nodes > 2 * attackers + 1:  # beta < 1/2 keeps a middle
        return RobustConfig(rule="trimmed-mean", trim_beta=(attackers + 0.5) / nodes)
    if rule == "mean":  # no defence, for comparison (fedge's default norm bound switched off)
        return RobustConfig(norm_multiple=0.0, weight_multiple=0.0)
    raise ValueError(f"{rule!r} cannot survive {attackers} attackers among {nodes} clients")


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the rounds with the sized rule and save the final model."""
    cfg = context.run_config
    nodes, attackers = int(cfg["num-nodes"]), int(cfg["attackers"])
    robust = sized_rule(str(cfg["rule"]), nodes, attackers)
    strategy = FedAvg(
        robust=robust, min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0
    )
    torch.manual_seed(0)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_net().state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=ConfigRecord(),
    )
    torch.save(result.arrays.to_torch_state_dict(), str(cfg["final-model"]))
