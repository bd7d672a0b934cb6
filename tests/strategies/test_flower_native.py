"""fedge strategies as Flower strategies: ``strategy.start`` in a plain Flower ServerApp.

Each test runs a real Flower ``ServerApp`` and ``ClientApp`` through the in-process
grid (:mod:`fedge.simulations.inprocess`), on a least-squares model small enough that a
whole federation takes well under a second.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import FedProx as FlowerFedProx
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedge import keys
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.strategies.base import NoReplyAccepted
from fedge.strategies.client import TrainRound
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.fedprox import FedProx
from fedge.strategies.scaffold import Scaffold

NODES, DIM, STEPS, LR = 4, 6, 5, 0.05


def _data(pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``pid``'s least-squares data: its own optimum, 20 + 10 pid examples."""
    rng = np.random.default_rng(pid)
    a = rng.normal(size=(20 + 10 * pid, DIM))
    b = a @ (np.ones(DIM) + 2.0 * rng.normal(size=DIM))
    return torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)


def _sgd(model: torch.nn.Linear, pid: int, fl: TrainRound | None) -> None:
    """STEPS full-batch SGD steps, with the fedge hooks when ``fl`` is given."""
    a, b = _data(pid)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = 0.5 * ((model(a).squeeze(1) - b) ** 2).mean()
        (loss + fl.loss_term() if fl is not None else loss).backward()
        if fl is not None:
            fl.correct_gradients()
        opt.step()


def _flower_client() -> ClientApp:
    """A Flower quickstart ClientApp with no fedge code: replies arrays + num-examples."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        model = torch.nn.Linear(DIM, 1)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        _sgd(model, pid, None)
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"num-examples": len(_data(pid)[1])}),
            }
        )
        return Message(content, reply_to=msg)

    return app


def _fedge_client(stores: dict[int, list[str]] | None = None) -> ClientApp:
    """The same ClientApp with fedge's TrainRound around its loop (3 added lines)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        model = torch.nn.Linear(DIM, 1)
        fl = TrainRound.start(msg, context, model)
        _sgd(model, pid, fl)
        reply = fl.reply(num_examples=len(_data(pid)[1]), local_steps=STEPS, lr=LR)
        if stores is not None:
            stores[pid] = sorted(context.state.array_records)
        return reply

    return app


def _run(strategy: FlowerStrategy, client: ClientApp, tmp_path: Path, rounds: int = 3) -> Result:
    """``strategy.start`` in a plain ServerApp on NODES in-process nodes; its Result."""
    box: list[Result] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        initial = ArrayRecord(torch.nn.Linear(DIM, 1).state_dict())
        box.append(
            strategy.start(
                grid=grid, initial_arrays=initial, num_rounds=rounds, train_config=ConfigRecord()
            )
        )

    grid = InProcessGrid(client, DeviceTable(NODES), tmp_path / "state")
    run_inprocess(server, grid)
    return box[0]


def _global_loss(arrays: ArrayRecord) -> float:
    """Mean client loss of a global model."""
    model = torch.nn.Linear(DIM, 1)
    model.load_state_dict(arrays.to_torch_state_dict())
    with torch.no_grad():
        return float(
            np.mean(
                [
                    0.5 * float(((model(a).squeeze(1) - b) ** 2).mean())
                    for a, b in map(_data, range(NODES))
                ]
            )
        )


SAMPLING = {"min_train_nodes": NODES, "min_available_nodes": NODES, "fraction_evaluate": 0.0}


def test_fedge_fedavg_is_a_drop_in_for_flowers_on_a_plain_flower_client(tmp_path: Path) -> None:
    """Same unmodified Flower ClientApp, same seeds: fedge's FedAvg ends where Flower's does."""
    flower = _run(FlowerFedAvg(**SAMPLING), _flower_client(), tmp_path / "a")  # type: ignore[arg-type]
    fedge = _run(FedAvg(**SAMPLING), _flower_client(), tmp_path / "b")
    assert isinstance(FedAvg(), FlowerStrategy)
    for k in flower.arrays:
        np.testing.assert_allclose(fedge.arrays[k].numpy(), flower.arrays[k].numpy(), atol=1e-6)
    assert set(fedge.train_metrics_clientapp) == {1, 2, 3}  # Flower's metric aggregation ran


def test_flowers_fedprox_and_fedges_agree_through_train_round(tmp_path: Path) -> None:
    """Flower's FedProx only sends proximal-mu; TrainRound adds the term, so both strategies
    train the same: Flower's reply averaging and fedge's contribution sum give one model."""
    flower = _run(FlowerFedProx(proximal_mu=0.5, **SAMPLING), _fedge_client(), tmp_path / "a")  # type: ignore[arg-type]
    fedge = _run(FedProx(proximal_mu=0.5, **SAMPLING), _fedge_client(), tmp_path / "b")
    plain = _run(FlowerFedAvg(**SAMPLING), _fedge_client(), tmp_path / "c")  # type: ignore[arg-type]
    for k in flower.arrays:
        np.testing.assert_allclose(fedge.arrays[k].numpy(), flower.arrays[k].numpy(), atol=1e-5)
    assert not np.allclose(plain.arrays["weight"].numpy(), flower.arrays["weight"].numpy())


def test_scaffold_runs_in_a_plain_flower_server_app_with_client_state(tmp_path: Path) -> None:
    """SCAFFOLD through strategy.start: c moves (c = sum ctrl / N), clients keep c_i in their
    Context, and with drift-prone data it ends below FedAvg's loss after the same rounds."""
    stores: dict[int, list[str]] = {}
    scaffold = Scaffold(**SAMPLING)
    result = _run(scaffold, _fedge_client(stores), tmp_path / "s", rounds=6)
    fedavg = _run(FedAvg(**SAMPLING), _fedge_client(), tmp_path / "f", rounds=6)
    state = scaffold.round_state
    assert state is not None and state.server_round == 6
    c = state.extras[keys.PREFIX_CONTROL + "weight"]
    assert np.abs(c).max() > 0
    assert all(any(k.startswith("fedge.client-state.round-") for k in v) for v in stores.values())
    assert len(stores) == NODES
    assert _global_loss(result.arrays) < _global_loss(fedavg.arrays)


def test_scaffold_refuses_a_plain_flower_reply_and_names_the_helper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Flower reply carries no control delta: every reply is refused, naming the helper, and
    a run in which no reply was accepted ends with that error, not with the initial model."""
    caplog.set_level(logging.WARNING, logger="fedge.strategies.base")
    with pytest.raises(NoReplyAccepted, match="TrainRound"):
        _run(Scaffold(**SAMPLING), _flower_client(), tmp_path / "b", rounds=1)
    assert "TrainRound" in caplog.text


def test_robust_rule_inside_flower_drops_a_poisoned_reply(tmp_path: Path) -> None:
    """A node that multiplies its update by -50 ruins fedge FedAvg's undefended mean, not its
    median, nor the default FedAvg (the adaptive norm bound refuses it; before it, the default
    FedAvg was the ruined mean)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        model = torch.nn.Linear(DIM, 1)
        fl = TrainRound.start(msg, context, model)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        _sgd(model, pid, fl)
        if pid == 0:  # the attacker: a scaled, sign-flipped update
            model.load_state_dict(
                {k: start[k] - 50 * (v - start[k]) for k, v in model.state_dict().items()}
            )
        return fl.reply(num_examples=len(_data(pid)[1]), local_steps=STEPS, lr=LR)

    from fedge.strategies.robust import RobustConfig

    clean = _run(FedAvg(**SAMPLING), _fedge_client(), tmp_path / "c")
    off = RobustConfig(norm_multiple=0, weight_multiple=0)  # the default defence off
    mean = _run(FedAvg(robust=off, **SAMPLING), app, tmp_path / "m")
    median = _run(FedAvg(robust=RobustConfig(rule="median"), **SAMPLING), app, tmp_path / "r")
    default = _run(FedAvg(**SAMPLING), app, tmp_path / "d")
    assert _global_loss(mean.arrays) > 10 * _global_loss(clean.arrays)
    assert _global_loss(median.arrays) < 1.5 * _global_loss(clean.arrays)
    assert _global_loss(default.arrays) < 1.5 * _global_loss(clean.arrays)
