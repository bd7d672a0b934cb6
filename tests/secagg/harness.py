"""Flower scaffolding for the SecAgg+ and privacy tests: a ClientApp of known replies, one run.

Used by ``tests/secagg/test_flower.py`` (sums and drop-outs over real messages) and
``tests/privacy/test_malicious_server.py`` (a server that attacks, clients that refuse).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedge import keys
from fedge.clients.mods import dispatch_mods
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

CRASH_KEY = "crash-pids"  # train-config key: comma list of partitions whose training crashes
NODES_TIMEOUT_S = 300  # nodes of a Ray or deployment run connect over time; bounds the wait

Contribution = Callable[[int], dict[str, np.ndarray]]


def known_client_app(contribution: Contribution, train_loss: Callable[[int], float]) -> ClientApp:
    """A ClientApp behind fedge's dispatch mod whose train reply partition ``pid`` knows in advance.

    Train replies carry ``contribution(pid)`` and the metrics ``train_loss(pid)`` and the
    partition id; partitions listed in the train config's ``crash-pids`` raise (a real
    fault). Query replies carry the partition id, mapping node ids to partitions.
    """
    app = ClientApp(mods=[dispatch_mods])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        crash = str(msg.content.config_records[keys.REC_CONFIG].get(CRASH_KEY, ""))
        if str(pid) in crash.split(","):
            raise RuntimeError("injected crash during local training")
        record = ArrayRecord({k: Array(v) for k, v in contribution(pid).items()})
        metrics = MetricRecord({keys.MET_TRAIN_LOSS: train_loss(pid), keys.MET_PARTITION: pid})
        content = RecordDict({keys.REC_CONTRIB: record, keys.REC_METRICS: metrics})
        return Message(content, reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({keys.REC_METRICS: MetricRecord({"pid": pid})}), reply_to=msg)

    return app


def partition_ids(grid: Grid, num_nodes: int) -> dict[int, int]:
    """Wait until ``num_nodes`` nodes are connected; map each node id to its partition.

    The query also loads the ClientApp in every worker before the rounds a test looks at.
    """
    deadline = time.monotonic() + NODES_TIMEOUT_S
    while len(list(grid.get_node_ids())) < num_nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {num_nodes} nodes after {NODES_TIMEOUT_S} s")
        time.sleep(0.1)
    nodes = sorted(grid.get_node_ids())
    query = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in nodes]
    return {
        r.metadata.src_node_id: int(r.content.metric_records[keys.REC_METRICS]["pid"])
        for r in grid.send_and_receive(query, timeout=NODES_TIMEOUT_S)
    }


def simulate(main: Callable[[Grid], None], client_app: ClientApp, num_nodes: int) -> None:
    """Run ``main(grid)`` as the ServerApp against ``num_nodes`` nodes on the in-process engine.

    The protocol under test lives in the ServerApp's aggregators and the ClientApp's mods,
    which see the same messages on any engine; the in-process one keeps each node's Context
    state on disk between the protocol's stages and answers a raising ClientApp with
    Flower's error reply, and needs no Ray start (about 35 s of a loaded suite per file).
    Flower's Ray simulation runs SecAgg+ in `tests/server/test_flower_engines.py`.
    """
    server_app = ServerApp()

    @server_app.main()
    def run(grid: Grid, context: Context) -> None:
        main(grid)

    with tempfile.TemporaryDirectory() as state:
        grid = InProcessGrid(client_app, DeviceTable(num_nodes), Path(state))
        run_inprocess(server_app, grid)
