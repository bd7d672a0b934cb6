"""A phone that vanishes after advertising its SecAgg+ keys is a dropout, recovered by the server.

Real parts: the SecAgg+ server aggregator, the SecAgg+ client mod (X25519, Shamir, masks),
the device grid and its clock. The transport is an in-process Grid that calls the
ClientApp directly (the device grid decides who answers; the transport only delivers).

Five devices, RTT 1 s, instantaneous links, 2 local steps of 1 s. Stage exchanges: keys
are advertised by 1 s; the collect stage opens at 1 s and a device reports at
1 + 1 + 2 = 4 s. Device 3 is eligible only until 2.5 s: it advertised its keys, then
vanished before reporting; the unmasked sum must be the other four's exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedge import keys
from fedge.clients.mods import dispatch_mods
from fedge.secagg.config import SecAggConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.simulations.devicesim.grid import DeviceGrid, DeviceSim
from fedge.simulations.devicesim.population import KIND_MS_PER_SAMPLE, Population, _pack
from fedge.simulations.devicesim.workload import ModelShape, Workload

NODES = [101, 102, 103, 104, 105]  # node i + 101 is device i
SIZE = 64

app = ClientApp(mods=[dispatch_mods])


def contribution(device: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(device)
    return {
        "delta/w": rng.normal(0, 0.05, SIZE).astype(np.float32),
        keys.KEY_WEIGHT: np.array([1.0], np.float32),
        keys.KEY_COUNT: np.array([1.0], np.float32),
    }


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Reply with this device's known contribution (what local training would produce)."""
    record = ArrayRecord(
        {k: Array(v) for k, v in contribution(context.node_config["device"]).items()}
    )  # type: ignore[arg-type]
    return Message(RecordDict({keys.REC_CONTRIB: record}), reply_to=msg)


class InProcessTransport(Grid):
    """Delivers each message to the ClientApp of its node in this thread, one Context per node."""

    def __init__(self) -> None:
        self.contexts = {
            n: Context(1, n, {"device": n - 101}, RecordDict(), {})
            for n in NODES  # type: ignore[arg-type]
        }
        self.delivered: list[tuple[int, str]] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(NODES)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.delivered.append((node, msg.metadata.message_type))
            replies.append(app(msg, self.contexts[node]))
        return replies

    # unused by the aggregator; required by the Grid interface
    def set_run(self, run):  # type: ignore[no-untyped-def]
        pass

    @property
    def run(self):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def population() -> Population:
    n = len(NODES)
    intervals = [[] for _ in range(n)]
    intervals[3] = [(0.0, 2.5)]
    offsets, starts, ends = _pack(intervals)
    return Population(
        ("phone",), np.zeros(n, np.int16), np.full(n, KIND_MS_PER_SAMPLE, np.int8),
        np.full(n, 1000 / 3), np.full(n, 1e12), np.full(n, 1e15), np.full(n, 1e15),
        np.full(n, 1.0), offsets, starts, ends, np.zeros(n),
    )  # fmt: skip


@pytest.fixture
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Flower sets in a ServerApp's thread: messages take their run and source from it."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.mark.usefixtures("server_identity")
def test_a_device_leaving_after_key_sharing_is_a_secagg_dropout() -> None:
    shape = ModelShape(
        params=10, hidden=2, layers=1, heads=1, kv_dim=2, intermediate=4, vocab=4, tied=True
    )
    sim = DeviceSim(
        population(),
        Workload(shape, 64, 1, 1, 2, 0, 0, reference_flops=0.0),  # ms/sample times this model,
    )
    transport = InProcessTransport()
    grid = DeviceGrid(transport, sim, lambda _g, nodes: {n: n - 101 for n in nodes})
    assert sorted(grid.get_node_ids()) == NODES  # everyone is eligible at 0 s
    config = {
        keys.CFG_SERVER_ROUND: 1,
        keys.CFG_LOCAL_STEPS: 2,
        keys.CFG_CLIENT_MODS: "",
        keys.CFG_TARGET_REPORTS: 0,
    }
    content = RecordDict(
        {
            keys.REC_GLOBAL: ArrayRecord({"w": Array(np.zeros(SIZE, np.float32))}),
            keys.REC_CONFIG: ConfigRecord(config),  # type: ignore[arg-type]
        }
    )
    spec = {k: v.shape for k, v in contribution(0).items()}
    aggregator = SecAggPlusAggregator(SecAggConfig(num_shares=5, reconstruction_threshold=3))
    result = aggregator.aggregate(grid, 1, NODES, content, spec, timeout=60)

    assert result.summed is not None, aggregator.last_failure
    assert sorted(result.accepted) == [101, 102, 103, 105]
    expected = sum(contribution(d)["delta/w"] for d in (0, 1, 2, 4))
    np.testing.assert_allclose(result.summed["delta/w"], expected, atol=1e-4)
    assert result.summed[keys.KEY_COUNT][0] == pytest.approx(4.0, abs=1e-4)
    # device 3 answered the key stage, then never got (or answered) the collect message
    assert [n for n, _ in transport.delivered].count(104) == 1
    assert sim.state.counters["dropped_offline"][3] == 1
    assert sim.state.counters["trained"][[0, 1, 2, 4]].tolist() == [1, 1, 1, 1]
    assert sim.state.clock_s == pytest.approx(5.0)  # unmasking: one more RTT after 4 s
    assert MessageType.TRAIN in {t for _, t in transport.delivered}


@pytest.mark.usefixtures("server_identity")
def test_device_state_survives_a_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A resumed run continues the clock, counters and round records of its checkpoint."""
    shape = ModelShape(
        params=10, hidden=2, layers=1, heads=1, kv_dim=2, intermediate=4, vocab=4, tied=True
    )
    work = Workload(shape, 64, 1, 1, 2, 0, 0, reference_flops=0.0)  # ms/sample times this model
    sim = DeviceSim(population(), work)
    grid = DeviceGrid(InProcessTransport(), sim, lambda _g, nodes: {n: n - 101 for n in nodes})
    content = RecordDict(
        {
            keys.REC_GLOBAL: ArrayRecord({"w": Array(np.zeros(SIZE, np.float32))}),
            keys.REC_CONFIG: ConfigRecord({keys.CFG_SERVER_ROUND: 1, keys.CFG_LOCAL_STEPS: 2}),  # type: ignore[arg-type]
        }
    )
    messages = [
        Message(content, dst_node_id=n, message_type=MessageType.TRAIN, group_id="1") for n in NODES
    ]
    assert len(list(grid.send_and_receive(messages))) == 4  # device 3 leaves at 2.5 s
    sim.end_round()
    sim.save(tmp_path / "state.npz")
    restored = DeviceSim(population(), work)
    restored.load(tmp_path / "state.npz")
    assert restored.state.clock_s == pytest.approx(sim.state.clock_s) == pytest.approx(3.0)
    assert restored.state.counters["trained"].tolist() == [1, 1, 1, 0, 1]
    assert [r.row() for r in restored.state.rounds] == [r.row() for r in sim.state.rounds]
