"""The in-process engine: a Flower Grid that runs ClientApps directly, with nodes joining and leaving."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedge import keys
from fedge.server.app import OutcomeBox, make_server_app
from fedge.server.config import RunConfig
from fedge.server.grid import ReplyHookGrid
from fedge.server.membership import Roster
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.simulations.runner import client_roots
from tests.simulations.federations import TINY_TRAINING

FAST = {
    "model": "zoo:micro",
    "num-server-rounds": 3,
    "max-chars-per-client": 20000,
    **TINY_TRAINING,
    "min-train-nodes": 2,
    "min-available-nodes": 2,
}


def _partition_app() -> ClientApp:
    """A ClientApp that only answers partition queries and counts calls in its Context.state."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        calls = context.state.config_records.get("calls", ConfigRecord({"n": 0}))
        context.state["calls"] = ConfigRecord({"n": int(calls["n"]) + 1})  # type: ignore[call-overload]
        pid = int(context.node_config[keys.NODE_PARTITION_ID])
        metrics = MetricRecord({keys.MET_PARTITION: pid, "calls": int(calls["n"]) + 1})
        return Message(RecordDict({keys.REC_METRICS: metrics}), reply_to=msg)

    return app


def _query(grid: Any, nodes: Iterable[int]) -> dict[int, int]:
    """What the round loop's partition query does, through the Grid interface only."""
    messages = [
        Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY, group_id="0")
        for n in nodes
    ]
    return {
        r.metadata.src_node_id: int(r.content.metric_records[keys.REC_METRICS][keys.MET_PARTITION])  # type: ignore[arg-type]
        for r in grid.send_and_receive(messages, timeout=60)
        if not r.has_error()
    }


def _grid(tmp_path: Path, size: int, app: ClientApp | None = None, **kw: Any) -> InProcessGrid:
    grid = InProcessGrid(app or _partition_app(), DeviceTable(size, **kw), tmp_path / "state")
    run_inprocess_identity(grid)
    return grid


def run_inprocess_identity(grid: InProcessGrid) -> None:
    """Set what run_inprocess sets before a ServerApp runs (Messages need a task identity)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID


def test_roster_follows_joins_leaves_and_reconnects(tmp_path: Path) -> None:
    """Sampling order is by partition; a reconnected device serves again under its new id."""
    online = np.array([True, True, True, False, True])
    grid = _grid(tmp_path, 5, online=online)
    roster = Roster(_query)
    first = roster.refresh(grid, minimum=1, timeout=1)
    assert [roster.partition(n) for n in first] == [0, 1, 2, 4]
    stale = grid.devices.node_ids[2].item()

    grid.disconnect([1])
    (new_id,) = grid.connect([2])  # device 2 restarts under a new node id
    grid.connect([3])
    again = roster.refresh(grid, minimum=1, timeout=1)
    assert [roster.partition(n) for n in again] == [0, 2, 3, 4]
    assert new_id in again and stale not in again
    assert len(set(again) & set(first)) == 2  # devices 0 and 4 kept their ids


def test_a_stale_node_still_listed_loses_its_partition_to_the_reconnected_one(
    tmp_path: Path,
) -> None:
    """A SuperLink that has not noticed a dead node yet lists both; the newer node serves."""
    grid = _grid(tmp_path, 3)
    stale = grid.devices.node_ids[1].item()

    class StaleListing(ReplyHookGrid):
        def get_node_ids(self) -> Iterable[int]:
            return sorted({*self._grid.get_node_ids(), stale})

    listing = StaleListing(grid)
    roster = Roster(_query)
    roster.refresh(listing, minimum=3, timeout=1)
    (fresh,) = grid.connect([1])
    ordered = roster.refresh(listing, minimum=3, timeout=1)
    assert ordered == [grid.devices.node_ids[0].item(), fresh, grid.devices.node_ids[2].item()]


def test_a_node_that_never_answers_is_queried_once_and_a_shortfall_is_named(
    tmp_path: Path,
) -> None:
    """A dead node costs one query, not one per round; too few nodes fail with the counts named."""

    class SilentOne(ReplyHookGrid):
        def get_node_ids(self) -> Iterable[int]:
            return [*self._grid.get_node_ids(), 12345]  # never registered: NODE_UNAVAILABLE

    grid = _grid(tmp_path, 2)
    silent = SilentOne(grid)
    roster = Roster(_query)
    for _ in range(3):
        assert len(roster.refresh(silent, minimum=2, timeout=1)) == 2
    assert grid.messages_run == 3  # two devices and the silent id, each asked once
    grid.disconnect([0, 1])
    with pytest.raises(TimeoutError, match="only 0 of the 2 nodes"):
        roster.refresh(silent, minimum=2, timeout=0)


def test_replies_carry_errors_state_persists_per_node_and_timeouts_drop_late_work(
    tmp_path: Path,
) -> None:
    """Offline -> NODE_UNAVAILABLE; Context.state survives calls but not a reconnect; late replies drop."""
    now = [0.0]
    app = _partition_app()

    @app.train()
    def slow(msg: Message, context: Context) -> Message:
        now[0] += 10.0  # each call "takes" 10 s on the grid's clock
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(app, DeviceTable(4), tmp_path / "state", clock=lambda: now[0])
    run_inprocess_identity(grid)
    ids = list(grid.get_node_ids())
    for _ in range(3):
        _query(grid, ids[:1])
    calls = [
        int(r.content.metric_records[keys.REC_METRICS]["calls"])  # type: ignore[arg-type]
        for r in grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=ids[0], message_type=MessageType.QUERY)], timeout=5
        )
    ]
    assert calls == [4]
    grid.connect([0])
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == []  # reconnect: empty Context

    grid.disconnect([3])
    (offline,) = grid.send_and_receive(
        [Message(RecordDict(), dst_node_id=ids[3], message_type=MessageType.QUERY)]
    )
    assert offline.has_error() and offline.error.code == ErrorCode.NODE_UNAVAILABLE

    train = [
        Message(RecordDict(), dst_node_id=n, message_type=MessageType.TRAIN)
        for n in list(grid.get_node_ids())
    ]
    replies = list(grid.send_and_receive(train, timeout=15))
    assert [r.metadata.src_node_id for r in replies] == [train[0].metadata.dst_node_id]


def test_a_clientapp_exception_becomes_an_error_reply(tmp_path: Path) -> None:
    """A raising ClientApp never crashes the engine; the reply says what went wrong."""
    app = ClientApp()

    @app.train()
    def broken(msg: Message, context: Context) -> Message:
        raise RuntimeError("out of memory on this phone")

    grid = _grid(tmp_path, 1, app=app)
    (reply,) = grid.send_and_receive(
        [Message(RecordDict(), dst_node_id=next(iter(grid.get_node_ids())), message_type="train")]
    )
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "out of memory on this phone" in reply.error.reason


def test_a_raising_clientapp_leaves_the_last_completed_state(tmp_path: Path) -> None:
    """States are cached as objects between messages; a call that raised must not leak its edits."""
    app = _partition_app()

    @app.train()
    def half_done(msg: Message, context: Context) -> Message:
        context.state["calls"] = ConfigRecord({"n": 100})  # edited, then the app fails
        raise RuntimeError("battery died")

    grid = _grid(tmp_path, 1, app=app)
    node = next(iter(grid.get_node_ids()))

    def call(kind: str) -> Message:
        (reply,) = grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=node, message_type=kind)]
        )
        return reply

    call(MessageType.QUERY)  # calls = 1, saved (and cached)
    assert call(MessageType.TRAIN).has_error()
    after = call(MessageType.QUERY)
    assert after.content.metric_records[keys.REC_METRICS]["calls"] == 2


def test_ten_thousand_devices_cost_a_few_hundred_bytes_each(tmp_path: Path) -> None:
    """Build, list and sample 10,000 devices and run the sampled 100: memory per device stays small."""

    def peak(size: int) -> int:
        tracemalloc.start()
        grid = _grid(tmp_path / str(size), size, app=_stateless_app())
        ordered = Roster(None).refresh(grid, minimum=size, timeout=0)
        picks = np.random.default_rng(0).choice(len(ordered), size=100, replace=False)
        assert len(_query(grid, [ordered[int(i)] for i in picks])) == 100
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(100), peak(10_000)
    per_device = (large - small) / 9_900
    assert per_device < 600, f"{per_device:.0f} bytes per device (a Context object alone is ~640)"


def _stateless_app() -> ClientApp:
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        pid = int(context.node_config[keys.NODE_PARTITION_ID])
        return Message(
            RecordDict({keys.REC_METRICS: MetricRecord({keys.MET_PARTITION: pid})}), reply_to=msg
        )

    return app


def _run_with_membership(
    tmp_path: Path, changes: Mapping[int, Any], doomed: set[int]
) -> list[dict[str, Any]]:
    """A real federation (micro zoo) on the in-process engine; ``changes[r](grid)`` after round r.

    When device 0 trains, every device in ``doomed`` disconnects (a node dying mid-round).
    """
    from fedge.clients import app as deployed
    from fedge.clients.mods import dispatch_mods
    from fedge.lm import holder
    from fedge.simulations.devices import device_mod

    grid = InProcessGrid(
        ClientApp(), DeviceTable(6, online=np.array([1, 1, 1, 1, 0, 0])), tmp_path / "state"
    )

    def doom(msg: Message, context: Context, call_next: Any) -> Message:
        if (
            context.node_config[keys.NODE_PARTITION_ID] == 0
            and msg.metadata.message_type == "train"
        ):
            grid.disconnect(sorted(doomed))
        return call_next(msg, context)  # type: ignore[no-any-return]

    app = ClientApp(mods=[doom, device_mod, dispatch_mods])
    app.query()(deployed.query)
    app.train()(deployed.train)
    grid._app = app  # the grid and the mod refer to each other
    cfg = RunConfig.from_mapping(
        {**FAST, "run-dir": str(tmp_path / "run"), "client-state-dir": str(tmp_path / "cs")}
    )
    rows: list[dict[str, Any]] = []

    def on_row(row: Mapping[str, Any]) -> None:
        rows.append(dict(row))
        if row["round"] in changes:
            changes[row["round"]](grid)

    box = OutcomeBox()
    holder.configure_threads(0)
    with client_roots(cfg):  # the test runs every node: their roots hold its paths
        run_inprocess(make_server_app(cfg, on_row=on_row, box=box), grid)
    assert box.outcome is not None and box.outcome.status == "completed", box.outcome
    return rows


def test_nodes_join_leave_and_die_mid_round_in_a_real_federation(micro_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """After round 1 device 1 leaves, 4 and 5 join, 2 reconnects; in round 3 device 5 dies mid-round."""
    doomed: set[int] = set()

    def round_1(grid: InProcessGrid) -> None:
        grid.disconnect([1])
        grid.connect([4, 5, 2])

    rows = _run_with_membership(tmp_path, {1: round_1, 2: lambda _grid: doomed.add(5)}, doomed)
    by_round = {r["round"]: r for r in rows}
    assert by_round[1]["partitions_trained"] == [0, 1, 2, 3]
    assert by_round[2]["partitions_trained"] == [0, 2, 3, 4, 5]
    assert by_round[2]["clients_connected"] == 5
    assert by_round[3]["partitions_trained"] == [0, 2, 3, 4]
    (why,) = by_round[3]["rejected"].values()
    assert "not connected" in why
    assert by_round[3]["status"] == "ok"


def test_a_superlink_error_reply_is_charged_to_the_node_it_answers_for(tmp_path: Path) -> None:
    """The SuperLink writes NODE_UNAVAILABLE replies from itself; the round names the dead node."""
    from flwr.common.constant import SUPERLINK_NODE_ID

    from fedge.server.aggregation import PlainAggregator

    class LikeSuperLink(ReplyHookGrid):
        def on_reply(self, msg: Message) -> Message:
            if msg.has_error():  # what Flower's LinkState does for an offline node
                msg.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
            return msg

    grid = _grid(tmp_path, 2, app=_stateless_app())
    alive, dead = list(grid.get_node_ids())
    grid.disconnect([1])
    result = PlainAggregator().aggregate(
        LikeSuperLink(grid), 1, [alive, dead], RecordDict(), {"x": (1,)}, timeout=60
    )
    assert set(result.rejected) == {alive, dead}
    assert "Node Unavailable" in result.rejected[dead] or "not connected" in result.rejected[dead]
    assert SUPERLINK_NODE_ID not in result.rejected


def test_under_simulated_devices_a_slow_machine_drops_no_client_the_clock_kept(
    tmp_path: Path,
) -> None:
    """Each call takes 10 s of wall clock, the round timeout is 15 s. Without devices the engine
    keeps its documented bound (1 of 4 replies: the second ends at 20 s, the third never
    starts). With a [devices] table the virtual clock has already chosen who reports, so all
    4 come back (on main the wall clock dropped 3 of the clients the virtual clock had
    recorded as trained, a number set by this machine's speed)."""
    from fedge.simulations.runner import _scenario_from_tables, inprocess_grid

    now = [0.0]
    app = _partition_app()

    @app.train()
    def slow(msg: Message, context: Context) -> Message:
        now[0] += 10.0
        return Message(RecordDict(), reply_to=msg)

    kept = {}
    for name, devices in (("plain", None), ("devices", {"size": 4})):
        scenario = _scenario_from_tables(
            name, {"num-supernodes": 4, "engine": "inprocess"}, {}, None, None, devices
        )
        grid = inprocess_grid(scenario, app, tmp_path / name, seed=0, clock=lambda: now[0])
        run_inprocess_identity(grid)
        train = [
            Message(RecordDict(), dst_node_id=n, message_type=MessageType.TRAIN)
            for n in grid.get_node_ids()
        ]
        kept[name] = len(list(grid.send_and_receive(train, timeout=15)))
    assert kept == {"plain": 1, "devices": 4}


def test_n_is_the_known_population_not_the_partitions_seen_so_far(tmp_path: Path) -> None:
    """Ten devices, four connected: SCAFFOLD's 1/N and the accountant's sampling rate use N = 10,
    through any Grid wrapper, from the first round (on main N was the 4 partitions seen so far,
    so the first control-variate updates were 10/4 too large). An engine that does not know
    its population (Flower's Ray engine) still learns N from the partitions seen."""
    from fedge.server.membership import federation_size

    grid = _grid(tmp_path, 10, online=np.array([1] * 4 + [0] * 6))
    roster = Roster(_query)
    roster.refresh(grid, 4, 5)
    assert federation_size(ReplyHookGrid(grid), roster) == 10
    unsized = ReplyHookGrid(grid)
    unsized._grid = object()  # type: ignore[assignment]  # an engine with no population_size
    assert federation_size(unsized, roster) == 4
