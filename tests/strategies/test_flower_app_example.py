"""examples/flower-app runs as written: Flower's FedAvg, fedge's SCAFFOLD and SCAFFOLD under
fedge's SecAgg+, one run-config key apart.

The example's own ServerApp and ClientApp run through fedge's in-process grid
(``fedge.simulations.inprocess``: no SuperLink, no ports, no Ray), with the run config
``flwr run --run-config`` would pass.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.strategies.base import NoReplyAccepted
from tests.simulations.federations import RecordingGrid

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-app"
NUM_NODES, NUM_ROUNDS = 4, 3


@pytest.fixture(scope="module")
def example() -> Iterator[tuple[Any, Any, Any]]:
    """The example's package, imported from its directory as `flwr run` would."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from flowerapp import client_app, server_app, task

        yield client_app, server_app, task
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def runs(example: tuple[Any, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Run the example once per strategy (on first use); keep the final model and the grid."""
    client_app, server_app, _ = example
    done: dict[str, tuple[dict[str, torch.Tensor], RecordingGrid, InProcessGrid]] = {}
    with pytest.MonkeyPatch.context() as mp:

        def run(strategy: str) -> tuple[dict[str, torch.Tensor], RecordingGrid, InProcessGrid]:
            if strategy not in done:
                root = tmp_path_factory.mktemp(strategy)
                mp.setenv(STATE_DIR_ENV, str(root / "keys"))  # SecAgg+ identities of this run
                out = root / "final_model.pt"
                config = {
                    "strategy": strategy,
                    "num-server-rounds": NUM_ROUNDS,
                    "final-model": str(out),
                }
                grid = InProcessGrid(client_app.app, DeviceTable(NUM_NODES), root / "state")
                recording = RecordingGrid(grid)
                run_inprocess(server_app.app, recording, run_config=config)  # type: ignore[arg-type]
                done[strategy] = (torch.load(out), recording, grid)
            return done[strategy]

        yield run


def _accuracy(task: Any, state_dict: dict[str, torch.Tensor]) -> float:
    """Accuracy of a model on the union of the four clients' data."""
    net = task.Net()
    net.load_state_dict(state_dict)
    scores = [task.evaluate(net, *task.load_data(p, NUM_NODES))[1] for p in range(NUM_NODES)]
    return sum(scores) / len(scores)


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold", "scaffold-secagg"])
def test_the_example_trains_under_every_strategy(example, runs, strategy: str) -> None:  # type: ignore[no-untyped-def]
    """4 nodes, 3 rounds: the saved final model beats the initial one by a clear margin."""
    # Prepare / Execute
    _, _, task = example
    final, _, grid = runs(strategy)
    torch.manual_seed(0)
    initial = _accuracy(task, task.Net().state_dict())
    # Assert
    assert _accuracy(task, final) > initial + 0.2, (initial, _accuracy(task, final))
    # train + evaluate on every node every round; SecAgg+ adds key advertising (round 1 only)
    # and an unmask stage to some nodes every round
    per_round = NUM_NODES * 2
    if strategy == "scaffold-secagg":
        assert grid.messages_run > NUM_ROUNDS * per_round + NUM_NODES
    else:
        assert grid.messages_run == NUM_ROUNDS * per_round


def test_secagg_ends_where_plain_scaffold_ends_and_hides_every_update(example, runs) -> None:  # type: ignore[no-untyped-def]
    """SCAFFOLD under SecAgg+ only adds quantization noise (levels 2^22 over [-8, 8] after the
    1/1000 example-weight scale: about 4e-3 per weighted value, 1e-5 after dividing by the 1,024
    examples; 2e-5 measured after three rounds), so it ends within 2e-4 of plain SCAFFOLD in
    every parameter; and no reply the server received holds a contribution or train metrics."""
    # Prepare / Execute
    _, _, task = example
    plain, _, _ = runs("scaffold")
    secure, recording, _ = runs("scaffold-secagg")
    # Assert: the same model up to quantization
    for name, value in plain.items():
        assert np.allclose(secure[name].numpy(), value.numpy(), atol=2e-4), name
    assert abs(_accuracy(task, secure) - _accuracy(task, plain)) <= 0.01
    # Assert: the server saw masked vectors only (evaluate replies carry eval metrics alone)
    trains = [m for m in recording.replies if m.metadata.message_type == "train"]
    assert trains and all(not m.has_error() for m in trains)
    for msg in trains:
        assert keys.REC_CONTRIB not in msg.content.array_records
        assert keys.REC_METRICS not in msg.content.metric_records


def test_a_server_that_drops_secagg_gets_nothing_from_a_node_that_requires_it(
    example: tuple[Any, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: the server switches the strategy line back to bare SCAFFOLD to read each node's
    update. The nodes' own policy (``require-secagg = true``, held by the node, never sent by
    the server) makes the example's ClientApp refuse every train and evaluate message, so no
    contribution reaches the server and no round aggregates. On the old example
    (a ClientApp without ``dispatch_mods``) the same run returned all four contributions in
    the clear (RUN against the old code)."""
    # Prepare
    client_app, server_app, _ = example
    policy = tmp_path / "policy.toml"
    policy.write_text("require-secagg = true\n")
    monkeypatch.setenv("FEDGE_PRIVACY_POLICY", str(policy))
    out = tmp_path / "final_model.pt"
    grid = RecordingGrid(InProcessGrid(client_app.app, DeviceTable(NUM_NODES), tmp_path / "st"))
    # Execute
    config = {"strategy": "scaffold", "num-server-rounds": 1, "final-model": str(out)}
    with pytest.raises(NoReplyAccepted, match="require-secagg"):  # no round aggregated
        run_inprocess(server_app.app, grid, run_config=config)  # type: ignore[arg-type]
    # Assert
    assert len(grid.replies) == 2 * NUM_NODES
    for msg in grid.replies:
        assert msg.has_error() and "require-secagg" in msg.error.reason
    assert not out.exists()  # the ServerApp stopped with the error: no untrained model saved
