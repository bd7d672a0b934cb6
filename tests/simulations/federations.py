"""What the small real federations of tests/simulations share: a micro-zoo config and the ClientApp."""

from __future__ import annotations

import os
from collections.abc import Sequence

from flwr.app import Message
from flwr.clientapp import ClientApp

from fedge.server.grid import ReplyHookGrid
from fedge.simulations.inprocess import InProcessGrid
from tests.process_state import process_state_restored

# One local step on tiny windows at LoRA rank 2, no client evaluation, no merged model and no
# plots (tests/privacy/test_matrix.py and the simulate tests check those): the training part of
# every small real federation in the tests.
TINY_TRAINING = {
    "local-steps": 1,
    "batch-size": 2,
    "seq-len": 16,
    "lora-r": 2,
    "lora-alpha": 4,
    "client-eval": False,
    "server-eval-batches": 1,
    "save-merged": False,
    "plots": False,
}

CONFIG = {
    "model": "zoo:micro",
    "strategy": "scaffold",
    "num-server-rounds": 3,
    "max-chars-per-client": 20000,
    **TINY_TRAINING,
    "min-train-nodes": 2,
    "min-available-nodes": 2,
}


def client_app() -> ClientApp:
    """The deployed ClientApp's query and train handlers behind fedge's mods, in this process."""
    from fedge.clients import app as deployed
    from fedge.clients.mods import dispatch_mods

    app = ClientApp(mods=[dispatch_mods])
    app.query()(deployed.query)
    app.train()(deployed.train)
    return app


class RecordingGrid(ReplyHookGrid):
    """An in-process grid that keeps every reply the ServerApp receives."""

    def __init__(self, grid: InProcessGrid) -> None:
        super().__init__(grid)
        self.replies: list[Message] = []

    def on_reply(self, msg: Message) -> Message:
        self.replies.append(msg)
        return msg


def simulate_here(args: Sequence[str]) -> str:
    """Run `fedge simulate ARGS` in this process (no start-up imports: ~5 CPU s less than a
    child) and return its output, failing with it on a non-zero exit. The in-process engine's
    process globals (the environment, Flower's TaskIdentity) are restored afterwards
    (`tests.process_state`: a module fixture runs outside a test's own restoring)."""
    from typer.testing import CliRunner

    from fedge.simulations.cli import app

    with process_state_restored():
        os.environ["FEDGE_CONCURRENCY"] = "1"
        result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output[-3000:]
    return result.output
