"""The in-process engine: a Flower ``Grid`` that runs the ClientApp directly, one message at a time.

Flower's simulation engine ships every message through a LinkState, polls it every
0.1 s, runs ClientApps in Ray actors and keeps one ``Context`` object per node.
On a tiny per-client workload that machinery, not training, sets the pace (about
0.05x of a bare torch loop here), and its per-node objects grow with the population.
:class:`InProcessGrid` keeps what a ServerApp can observe through the ``Grid``
interface (node ids, message ids, replies, error replies, timeouts) and drops the
rest: a pushed message runs the ClientApp in this thread, at once, so the same
ServerApp and ClientApp run here, under Flower's Ray simulation and under the
Deployment Engine. The design follows pfl-research's simulator: one model per
worker process, updated in place, and users as rows rather than objects.

Devices are rows of :class:`DeviceTable` (a node id and an online flag per device,
plus optional numeric columns that go into the node config); a node's ``Context``
is built per message from its row, and a non-empty ``Context.state`` is kept on
disk (the last 1,024 used also as objects, so a busy node's state is not re-read every
message), so memory does not grow with the population. Membership changes between
messages: :meth:`InProcessGrid.disconnect` and :meth:`InProcessGrid.connect` (a
reconnecting device gets a new node id, as a restarted SuperNode does).

Differences from Flower's engines, by design: messages run one after another (the
round timeout bounds their sum: a message not started by the deadline gets no
reply, a reply finished after it is dropped; under simulated devices the wall-clock
timeout is off, ``wall_clock_timeout=False``, since the virtual clock has already decided
who reports, and which clients dropped must not depend on this machine's speed); a message to a disconnected node is
answered at once with Flower's ``NODE_UNAVAILABLE`` error; the records of one
message content are shared, not copied, between the messages of a round, so a
ClientApp must replace a received record rather than edit it in place (fedge's
apps and mods only build new records).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedge.simulations.flower_internals import set_message_id

log = logging.getLogger(__name__)

NODE_UNAVAILABLE_REASON = "node is not connected (it left the federation)"
_NODE_ID_LOW = 1 << 32  # node ids look like Flower's random 64-bit ids: never a partition index


class DeviceTable:
    """The population as compact arrays: one row per device, its current node id and online flag.

    A device's row index is its ``partition-id``; ``num-partitions`` in every node
    config is the population size (Flower's simulation convention). ``columns`` are
    extra per-device numbers (e.g. a device tier) copied into the node config.
    """

    def __init__(
        self,
        size: int,
        seed: int = 0,
        online: np.ndarray | None = None,
        columns: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        if size <= 0:
            raise ValueError(f"population size must be > 0, got {size}")
        self.size = size
        self._rng = np.random.default_rng([seed, size])
        self.node_ids = np.zeros(size, dtype=np.int64)
        self.online = np.ones(size, dtype=bool) if online is None else online.astype(bool)
        if self.online.shape != (size,):
            raise ValueError(f"online mask has shape {self.online.shape}, expected ({size},)")
        self.columns = dict(columns or {})
        for name, column in self.columns.items():
            if column.shape != (size,):
                raise ValueError(f"column {name!r} has shape {column.shape}, expected ({size},)")
        self._assign_ids(np.arange(size))
        self._index: tuple[np.ndarray, np.ndarray] | None = None

    def _assign_ids(self, rows: np.ndarray) -> None:
        """Give ``rows`` fresh random node ids, unique among the current ones."""
        ids = self._rng.integers(_NODE_ID_LOW, np.iinfo(np.int64).max, size=len(rows))
        while len(np.unique(ids)) < len(ids) or np.isin(ids, self.node_ids).any():
            ids = self._rng.integers(_NODE_ID_LOW, np.iinfo(np.int64).max, size=len(rows))
        self.node_ids[rows] = ids
        self._index = None

    def row_of(self, node_id: int) -> int | None:
        """The device row behind a node id (None for an unknown or retired id)."""
        if self._index is None:
            order = np.argsort(self.node_ids)
            self._index = (self.node_ids[order], order)
        ids, order = self._index
        pos = int(np.searchsorted(ids, node_id))
        if pos < len(ids) and ids[pos] == node_id:
            return int(order[pos])
        return None

    def connect(self, rows: Sequence[int]) -> list[int]:
        """Bring devices online under new node ids (a reconnect never reuses an id); return them."""
        picked = self._rows(rows)
        self._assign_ids(picked)
        self.online[picked] = True
        return [int(n) for n in self.node_ids[picked]]

    def disconnect(self, rows: Sequence[int]) -> None:
        """Take devices offline; messages to their node ids get NODE_UNAVAILABLE replies."""
        self.online[self._rows(rows)] = False

    def node_config(self, row: int) -> dict[str, int | float]:
        """The node config a device's ClientApp sees: partition, population size, extra columns."""
        config: dict[str, int | float] = {PARTITION_ID_KEY: row, NUM_PARTITIONS_KEY: self.size}
        for name, column in self.columns.items():
            config[name] = column[row].item()
        return config

    def _rows(self, rows: Sequence[int]) -> np.ndarray:
        picked = np.asarray(rows, dtype=np.int64)
        if picked.size and (picked.min() < 0 or picked.max() >= self.size):
            raise ValueError(f"device rows must be in [0, {self.size}), got {list(rows)[:5]}")
        return picked


class NodeStates:
    """``Context.state`` of the nodes that keep any, one file per device row; empty states cost nothing.

    Every save is written through to disk; the states of the ``cache_rows`` rows used last are
    also kept as objects, so the next message to such a node skips reading and parsing its file
    (memory stays bounded whatever the population). :meth:`forget_cached` drops a row's object
    when its ClientApp failed mid-message, so the file (the last completed state) is read again.
    """

    def __init__(self, root: Path, size: int, cache_rows: int = 1024) -> None:
        self.root = root
        self._present = np.zeros(size, dtype=bool)
        self._cache: OrderedDict[int, RecordDict] = OrderedDict()
        self._cache_rows = cache_rows
        root.mkdir(parents=True, exist_ok=True)
        for path in root.glob("*.pb"):
            if path.stem.isdigit() and int(path.stem) < size:
                self._present[int(path.stem)] = True

    def load(self, row: int) -> RecordDict:
        """The row's state (a fresh, empty RecordDict when it has none)."""
        if not self._present[row]:
            return RecordDict()
        if row in self._cache:
            self._cache.move_to_end(row)
            return self._cache[row]
        return recorddict_from_proto(ProtoRecordDict.FromString((self._path(row)).read_bytes()))

    def save(self, row: int, state: RecordDict) -> None:
        """Keep a non-empty state (atomic replace); forget an emptied one."""
        if len(state) == 0:
            self.drop(row)
            return
        tmp = self._path(row).with_suffix(".tmp")
        tmp.write_bytes(recorddict_to_proto(state).SerializeToString())
        tmp.replace(self._path(row))
        self._present[row] = True
        self._cache[row] = state
        self._cache.move_to_end(row)
        if len(self._cache) > self._cache_rows:
            self._cache.popitem(last=False)

    def forget_cached(self, row: int) -> None:
        """Drop the row's object (its file stays): the next load reads the last saved state."""
        self._cache.pop(row, None)

    def drop(self, row: int) -> None:
        """Forget the row's state (a node that reconnects starts with an empty Context)."""
        self._cache.pop(row, None)
        if self._present[row]:
            self._path(row).unlink(missing_ok=True)
            self._present[row] = False

    def _path(self, row: int) -> Path:
        return self.root / f"{row}.pb"


class InProcessGrid(Grid):
    """A Grid whose pushed messages run the ClientApp in this thread; replies wait to be pulled."""

    def __init__(
        self,
        client_app: ClientApp,
        devices: DeviceTable,
        state_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_timeout: bool = True,
    ) -> None:
        self._app = client_app
        self.devices = devices
        self._states = NodeStates(state_dir, devices.size)
        self._clock = clock
        self._timeout_applies = wall_clock_timeout
        self._run = Run.create_empty(0)
        self._replies: dict[str, Message] = {}
        self.messages_run = 0

    # ------------------------------------------------------------ membership
    def connect(self, rows: Sequence[int]) -> list[int]:
        """Bring devices online with new node ids; a reconnected node's Context starts empty."""
        for row in rows:
            self._states.drop(int(row))
        return self.devices.connect(rows)

    def disconnect(self, rows: Sequence[int]) -> None:
        """Take devices offline (their pending and future messages fail with NODE_UNAVAILABLE)."""
        self.devices.disconnect(rows)

    @property
    def population_size(self) -> int:
        """Every device this engine may ever connect: the federation's N (SCAFFOLD, the accountant)."""
        return self.devices.size

    # ------------------------------------------------------------ Grid
    def set_run(self, run: Run) -> None:
        """Set the run whose id every message and Context carries."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run this grid serves."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A message for ``dst_node_id`` (Flower deprecates this in favour of ``Message(...)``)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """The node ids of the devices connected now."""
        return self.devices.node_ids[self.devices.online].tolist()  # type: ignore[no-any-return]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message's ClientApp now; its reply waits under the returned message id."""
        ids = []
        for msg in messages:
            self._stamp(msg)
            self._replies[msg.metadata.message_id] = self._execute(msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Hand over (and forget) the replies to these message ids."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Run the messages one after another; those not done by ``timeout`` seconds get no reply
        (unless the wall-clock timeout is off: a virtual clock already decided who reports)."""
        if not self._timeout_applies:
            timeout = None
        deadline = None if timeout is None else self._clock() + timeout
        replies = []
        for msg in messages:
            if deadline is not None and self._clock() >= deadline:
                break
            self._stamp(msg)
            reply = self._execute(msg)
            if deadline is None or self._clock() <= deadline:
                replies.append(reply)
        return replies

    # ------------------------------------------------------------ execution
    def _stamp(self, msg: Message) -> None:
        """Give the message the id the SuperLink would (Flower's own grids set it the same way)."""
        set_message_id(msg, uuid.uuid4().hex)

    def _execute(self, msg: Message) -> Message:
        """The ClientApp's reply to one message, or the error reply Flower's engines would give."""
        row = self.devices.row_of(msg.metadata.dst_node_id)
        if row is None or not self.devices.online[row]:
            reply = Message(
                Error(ErrorCode.NODE_UNAVAILABLE, NODE_UNAVAILABLE_REASON), reply_to=msg
            )
        else:
            reply = self._call(row, msg)
        set_message_id(reply, uuid.uuid4().hex)
        self.messages_run += 1
        return reply

    def _call(self, row: int, msg: Message) -> Message:
        """Build the node's Context from its row, run the ClientApp, keep the state it leaves."""
        context = Context(
            run_id=self._run.run_id,
            node_id=msg.metadata.dst_node_id,
            node_config=self.devices.node_config(row),  # type: ignore[arg-type]
            state=self._states.load(row),
            run_config=dict(self._run.override_config),
        )
        # The round's messages share one content: give each its own dict of (shared) records.
        msg.content = RecordDict(dict(msg.content.items()))
        try:
            reply = self._app(msg, context)
        except Exception as exc:  # an error reply, as Flower's engines give
            self._states.forget_cached(row)  # the app may have half-edited the state object
            log.warning(
                "node %d: ClientApp raised %s: %s",
                msg.metadata.dst_node_id,
                type(exc).__name__,
                exc,
            )
            return Message(
                Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}"),
                reply_to=msg,
            )
        self._states.save(row, context.state)
        return reply


def run_inprocess(
    server_app: ServerApp,
    grid: InProcessGrid,
    run_id: int = 1,
    run_config: Mapping[str, bool | int | float | str] | None = None,
) -> None:
    """Run ``server_app`` to the end on ``grid`` in this thread; both apps' Contexts carry
    ``run_config`` (as ``flwr run --run-config`` would give them), empty by default."""
    run = Run.create_empty(run_id)
    run.override_config = dict(run_config or {})
    grid.set_run(run)
    # What flwr.simulation sets for its ServerApp thread: new Messages take run and source from it.
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    context = Context(
        run_id=run_id,
        node_id=SUPERLINK_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=dict(run.override_config),
    )
    server_app(grid, context)
