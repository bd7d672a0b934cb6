"""examples/flower-app runs as written: Flower's FedAvg and fedge's SCAFFOLD, one run-config key apart.

The example's own ServerApp and ClientApp run through the in-process grid (no SuperLink,
no ports), with the run config ``flwr run --run-config`` would pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-app"


@pytest.fixture(scope="module")
def example():  # type: ignore[no-untyped-def]
    """The example's package, imported from its directory as `flwr run` would."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from flowerapp import client_app, server_app, task

        yield client_app, server_app, task
    finally:
        sys.path.remove(str(EXAMPLE))


def _accuracy(task, state_dict) -> float:  # type: ignore[no-untyped-def]
    """Accuracy of a model on the union of the four clients' data."""
    net = task.Net()
    net.load_state_dict(state_dict)
    scores = [task.evaluate(net, *task.load_data(p, 4))[1] for p in range(4)]
    return sum(scores) / len(scores)


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_the_example_trains_under_both_strategies(example, strategy: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """4 nodes, 3 rounds: the saved final model beats the initial one by a clear margin."""
    client_app, server_app, task = example
    out = tmp_path / "final_model.pt"
    run_config = {"strategy": strategy, "num-server-rounds": 3, "final-model": str(out)}
    grid = InProcessGrid(client_app.app, DeviceTable(4), tmp_path / "state")
    run_inprocess(server_app.app, grid, run_config=run_config)
    torch.manual_seed(0)
    initial = _accuracy(task, task.Net().state_dict())
    final = _accuracy(task, torch.load(out))
    assert final > initial + 0.2, (initial, final)
    assert grid.messages_run == 4 * 3 * 2  # train + evaluate on every node every round
