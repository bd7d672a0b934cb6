"""examples/flower-scaffold-secagg and examples/flower-robust run as written.

Each example's own ServerApp and ClientApp run through fedge's in-process grid (no SuperLink,
no ports, no Ray) with the run config ``flwr run --run-config`` would pass, as
tests/strategies/test_flower_app_example.py runs examples/flower-app.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from tests.process_state import process_state_restored
from tests.simulations.federations import RecordingGrid

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(directory: str, package: str) -> Iterator[tuple[Any, Any, Any]]:
    """An example's package, imported from its directory as `flwr run` would."""
    sys.path.insert(0, str(EXAMPLES / directory))
    try:
        client_app = __import__(f"{package}.client_app", fromlist=["app"])
        server_app = __import__(f"{package}.server_app", fromlist=["app"])
        task = __import__(f"{package}.task", fromlist=["make_net"])
        yield client_app, server_app, task
    finally:
        sys.path.remove(str(EXAMPLES / directory))


@pytest.fixture(scope="module")
def scaffold_secagg() -> Iterator[tuple[Any, Any, Any]]:
    yield from _load("flower-scaffold-secagg", "scaffoldsecagg")


@pytest.fixture(scope="module")
def robust() -> Iterator[tuple[Any, Any, Any]]:
    yield from _load("flower-robust", "robustapp")


def _run(example: tuple[Any, Any, Any], nodes: int, root: Path, **config: Any) -> RecordingGrid:
    """Run the example's apps on ``nodes`` in-process nodes; the final model is root/final.pt."""
    client_app, server_app, _ = example
    defaults = {"num-server-rounds": 3, "local-steps": 10, "lr": 0.05, "num-nodes": nodes}
    grid = RecordingGrid(InProcessGrid(client_app.app, DeviceTable(nodes), root / "state"))
    run_config = {**defaults, **config, "final-model": str(root / "final.pt")}
    with process_state_restored():
        run_inprocess(server_app.app, grid, run_config=run_config)  # type: ignore[arg-type]
    return grid


def _accuracy(task: Any, state_dict: dict[str, torch.Tensor] | None, nodes: int) -> float:
    """Accuracy on the union of the nodes' data (the initial model when ``state_dict`` is None)."""
    torch.manual_seed(0)
    net = task.make_net()
    if state_dict is not None:
        net.load_state_dict(state_dict)
    hits = []
    for p in range(nodes):
        x, y = task.load_data(p, nodes)
        with torch.no_grad():
            hits.append(float((net(x).argmax(1) == y).float().mean()))
    return sum(hits) / len(hits)


def test_scaffold_secagg_trains_and_the_server_sees_only_masked_vectors(
    scaffold_secagg: tuple[Any, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 nodes, 3 rounds of SCAFFOLD under SecAgg+: the final model beats the initial one by a
    clear margin, and no train reply the server received holds a contribution or metrics."""
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "keys"))
    grid = _run(scaffold_secagg, 4, tmp_path)
    task = scaffold_secagg[2]
    final = torch.load(tmp_path / "final.pt")
    assert _accuracy(task, final, 4) > _accuracy(task, None, 4) + 0.2
    trains = [m for m in grid.replies if m.metadata.message_type == "train"]
    assert trains and all(not m.has_error() for m in trains)
    for msg in trains:
        assert keys.REC_CONTRIB not in msg.content.array_records
        assert keys.REC_METRICS not in msg.content.metric_records


def test_a_sized_robust_rule_survives_the_attacker_the_mean_does_not(
    robust: tuple[Any, Any, Any], tmp_path: Path
) -> None:
    """6 nodes, one sends -10x its update: under the plain mean the model ends worse than it
    started; Krum (f = 1) and the trimmed mean (beta = 1.5/6, one cut per tail) end well above."""
    task = robust[2]
    initial = _accuracy(task, None, 6)
    scores = {}
    for rule in ("mean", "krum", "trimmed-mean"):
        _run(robust, 6, tmp_path / rule, rule=rule, attackers=1)
        scores[rule] = _accuracy(task, torch.load(tmp_path / rule / "final.pt"), 6)
    assert scores["mean"] < initial + 0.05, (initial, scores)
    assert scores["krum"] > initial + 0.2, (initial, scores)
    assert scores["trimmed-mean"] > initial + 0.2, (initial, scores)


def test_a_rule_too_small_for_its_attackers_is_refused(robust: tuple[Any, Any, Any]) -> None:
    """Krum needs n >= 2f + 3 and the trimmed mean n > 2f + 1: 2 attackers of 6 is too many for
    Krum, 3 of 6 for the trimmed mean."""
    sized_rule = robust[1].sized_rule
    assert sized_rule("krum", 7, 2).krum_malicious == 2
    with pytest.raises(ValueError, match="cannot survive 2 attackers among 6"):
        sized_rule("krum", 6, 2)
    assert int(sized_rule("trimmed-mean", 6, 2).trim_beta * 6) == 2
    with pytest.raises(ValueError, match="cannot survive 3 attackers among 6"):
        sized_rule("trimmed-mean", 6, 3)
