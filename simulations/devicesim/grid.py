"""A Grid wrapper that puts every train message on the virtual clock of a device population.

The round loop and its aggregators talk to :class:`DeviceGrid` exactly as to Flower's
Grid. For each exchange of train messages it:

1. maps each destination node to its device (node -> partition id -> device row);
2. plans the exchange on the virtual clock (:mod:`.clock`): download, compute, upload,
   latency; availability; the round's deadline; the first ``target-reports`` kept;
3. sends only the messages of clients that report in time, each with its own config:
   ``step-budget`` when the deadline cuts its work (partial work, kept by strategies that
   accept it) and ``batch-size`` when its memory forced a smaller batch;
4. advances the clock to the exchange's close and records who trained, who dropped and why.

``get_node_ids`` answers the nodes whose device is eligible now (and fits in memory), so
the loop samples only from connected devices. Nothing sleeps: simulated time is computed.
Under SecAgg+ each protocol stage is an exchange: a device whose eligibility ends after it
shared its keys does not answer the collect stage, which SecAgg+ handles as a dropout.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.server.aggregation import reply_metrics
from fedge.server.grid import ReplyHookGrid
from fedge.simulations.devicesim import clock
from fedge.simulations.devicesim.clock import Leg, Plan, Rules
from fedge.simulations.devicesim.population import Population
from fedge.simulations.devicesim.workload import Workload, fit_batches

log = logging.getLogger(__name__)
PartitionQuery = Callable[[Grid, Sequence[int]], dict[int, int]]  # (grid, nodes) -> partitions

COUNTERS = (
    "selected",
    "trained",
    "partial",
    "steps",
    "dropped_offline",
    "dropped_deadline",
    "dropped_late",
    "compute_s",
    "wasted_s",
    "bytes_down",
    "bytes_up",
)


@dataclass
class RoundRecord:
    """What one round cost in simulated time and what happened to its selected clients."""

    round: int
    start_s: float
    end_s: float = 0.0
    eligible: int = 0
    selected: int = 0
    target: int = 0
    trained: int = 0
    partial: int = 0
    dropped_offline: int = 0
    dropped_deadline: int = 0
    dropped_late: int = 0
    compute_s: float = 0.0
    wasted_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0

    def row(self) -> dict[str, Any]:
        """The JSON row written to ``devices/rounds.jsonl``."""
        return {**self.__dict__, "round_s": self.end_s - self.start_s}


@dataclass
class DeviceState:
    """Everything the simulation accumulates: the clock, per-device counters, round records."""

    clock_s: float
    counters: dict[str, np.ndarray]
    rounds: list[RoundRecord] = field(default_factory=list)

    @classmethod
    def fresh(cls, size: int, start_s: float) -> DeviceState:
        """Zero counters for ``size`` devices, the clock at ``start_s``."""
        return cls(start_s, {name: np.zeros(size, dtype=np.float64) for name in COUNTERS})


class DeviceSim:
    """The device population of one run: its workload, memory fit, clock and counters."""

    def __init__(
        self,
        pop: Population,
        workload: Workload,
        *,
        deadline_s: float = 0.0,
        start_s: float = 0.0,
        shrink: bool = False,
    ) -> None:
        self.pop = pop
        self.workload = workload
        self.deadline_s = deadline_s
        self.batches = fit_batches(workload, pop.memory_bytes, shrink)
        usable = np.where(self.batches > 0, self.batches, workload.batch)
        self.step_s = workload.step_seconds(pop, usable)
        self.state = DeviceState.fresh(len(pop), start_s)
        self.node_device: dict[int, int] = {}
        self._round: RoundRecord | None = None

    @property
    def excluded(self) -> np.ndarray:
        """Devices that cannot train this model in their memory (never selected)."""
        return self.batches == 0

    def eligible(self, device: int) -> bool:
        """Whether a device is connected now (eligible) and fits the model in memory."""
        return bool(self.batches[device] > 0) and (
            self.pop.available_until(device, self.state.clock_s) is not None
        )

    # ------------------------------------------------------------ rounds
    def begin_round(self, server_round: int) -> RoundRecord:
        """Open round ``server_round`` at the current clock (closing the previous one)."""
        self.end_round()
        eligible = sum(self.eligible(d) for d in self.node_device.values())
        self._round = RoundRecord(server_round, self.state.clock_s, eligible=eligible)
        return self._round

    def end_round(self) -> None:
        """Close the open round, if any, at the current clock."""
        if self._round is not None:
            self._round.end_s = self.state.clock_s
            self.state.rounds.append(self._round)
            self._round = None

    def save(self, path: Path) -> None:
        """Persist the clock, counters and closed rounds (what a resumed run continues from)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        rounds = json.dumps([r.__dict__ for r in self.state.rounds])
        tmp = path.with_suffix(".tmp.npz")
        arrays: dict[str, Any] = {
            "clock_s": self.state.clock_s,
            "rounds": np.array(rounds),
            **self.state.counters,
        }
        np.savez(tmp, **arrays)
        tmp.replace(path)

    def load(self, path: Path) -> None:
        """Continue from a saved state (node ids are learnt again: they change across restarts)."""
        with np.load(path) as data:
            counters = {name: data[name].copy() for name in COUNTERS}
            rounds = [RoundRecord(**r) for r in json.loads(str(data["rounds"]))]
            self.state = DeviceState(float(data["clock_s"]), counters, rounds)
        self._round = None

    def current_round(self) -> RoundRecord | None:
        """The open round, or None between rounds."""
        return self._round

    def record(self, plan: Plan, training: bool, bytes_down: float, bytes_up: float) -> None:
        """Fold one exchange's plan into the counters and the open round; advance the clock."""
        c, r = self.state.counters, self._round
        for o in plan.outcomes:
            d = o.device
            c["compute_s"][d] += o.compute_seconds
            c["wasted_s"][d] += o.wasted_seconds
            if o.downloaded:
                c["bytes_down"][d] += bytes_down
            if o.status in (clock.KEPT, clock.LATE):
                c["bytes_up"][d] += bytes_up
            if training:
                c["selected"][d] += 1
                if o.status == clock.KEPT:
                    c["trained"][d] += 1
                    c["partial"][d] += o.partial
                else:
                    c[f"dropped_{o.status}"][d] += 1
            if r is not None:
                r.compute_s += o.compute_seconds
                r.wasted_s += o.wasted_seconds
                r.bytes_down += int(bytes_down) if o.downloaded else 0
                r.bytes_up += int(bytes_up) if o.status in (clock.KEPT, clock.LATE) else 0
        if r is not None and training:
            r.selected += len(plan.outcomes)
            r.trained += len(plan.by_status(clock.KEPT))
            r.partial += sum(o.partial for o in plan.outcomes)
            r.dropped_offline += len(plan.by_status(clock.OFFLINE))
            r.dropped_deadline += len(plan.by_status(clock.DEADLINE))
            r.dropped_late += len(plan.by_status(clock.LATE))
        self.state.clock_s = max(self.state.clock_s, plan.close)


class DeviceGrid(ReplyHookGrid):
    """Flower Grid wrapper: train exchanges run on the devices' virtual clock (module docstring)."""

    def __init__(self, grid: Grid, sim: DeviceSim, partition_query: PartitionQuery) -> None:
        super().__init__(grid)
        self.sim = sim
        self._query = partition_query  # (grid, node_ids) -> {node: partition}

    def get_node_ids(self) -> Iterable[int]:
        """Nodes whose device is eligible at the current simulated time and fits in memory."""
        nodes = sorted(self._grid.get_node_ids())
        self._learn(nodes)
        return [
            n
            for n in nodes
            if n in self.sim.node_device and self.sim.eligible(self.sim.node_device[n])
        ]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Train messages go through the virtual clock; every other message passes unchanged."""
        messages = list(messages)
        if not messages or any(m.metadata.message_type != MessageType.TRAIN for m in messages):
            return super().send_and_receive(messages, timeout=timeout)
        config = _config(messages[0])
        server_round = int(config.get(keys.CFG_SERVER_ROUND, 0))
        current = self.sim.current_round()
        if current is None or current.round != server_round:
            current = self.sim.begin_round(server_round)
        self._learn([m.metadata.dst_node_id for m in messages])
        plan, legs = self._plan(messages, config, current)
        kept = {o.node: o for o in plan.by_status(clock.KEPT)}
        outgoing = [
            self._for_device(m, kept[m.metadata.dst_node_id])
            for m in messages
            if m.metadata.dst_node_id in kept
        ]
        replies = list(self._grid.send_and_receive(outgoing, timeout=timeout)) if outgoing else []
        if len(replies) < len(outgoing):  # an engine's wall clock, not the virtual one, cut them
            log.warning(
                "round %d: %d of %d clients the virtual clock kept sent no reply before the "
                "wall-clock round-timeout; raise round-timeout",
                server_round,
                len(outgoing) - len(replies),
                len(outgoing),
            )
        training = any(leg.steps > 0 for leg in legs)
        self.sim.record(plan, training, legs[0].download_bytes, legs[0].upload_bytes)
        for reply in replies:  # the steps each client says it ran (its step budget honoured)
            device = self.sim.node_device.get(reply.metadata.src_node_id)
            if device is not None and not reply.has_error():
                steps = reply_metrics(reply).get(keys.MET_LOCAL_STEPS, 0.0)
                self.sim.state.counters["steps"][device] += steps
        return [self.on_reply(r) for r in replies]

    # ------------------------------------------------------------ helpers
    def _learn(self, nodes: Sequence[int]) -> None:
        """Map nodes not seen yet to devices through their partition ids."""
        unknown = [n for n in nodes if n not in self.sim.node_device]
        if not unknown:
            return
        for node, partition in self._query(self._grid, unknown).items():
            if partition >= len(self.sim.pop):
                raise ValueError(
                    f"node {node} has partition-id {partition}, but the device population has "
                    f"{len(self.sim.pop)} devices; give [devices] size >= the number of nodes"
                )
            self.sim.node_device[node] = partition

    def _plan(
        self, messages: Sequence[Message], config: dict[str, Any], current: RoundRecord
    ) -> tuple[Plan, list[Leg]]:
        """The legs of this exchange and their plan on the clock."""
        wl = self.sim.workload
        trains = keys.REC_GLOBAL in messages[0].content.array_records
        size = _array_bytes(messages[0].content)
        legs = [
            Leg(
                m.metadata.dst_node_id,
                self.sim.node_device.get(m.metadata.dst_node_id, -1),
                wl.download_bytes if trains else size,
                wl.upload_bytes if trains else size,
                int(config.get(keys.CFG_LOCAL_STEPS, wl.local_steps)) if trains else 0,
                float(self.sim.step_s[self.sim.node_device.get(m.metadata.dst_node_id, 0)]),
            )
            for m in messages
        ]
        unknown = [leg.node for leg in legs if leg.device < 0]
        if unknown:
            raise ValueError(
                f"nodes {unknown} did not report a partition id; they cannot be simulated"
            )
        target = int(config.get(keys.CFG_TARGET_REPORTS, 0)) if trains else 0
        deadline = current.start_s + self.sim.deadline_s if self.sim.deadline_s > 0 else math.inf
        rules = Rules(
            self.sim.state.clock_s,
            deadline,
            target,
            bool(config.get(keys.CFG_ACCEPT_PARTIAL, False)),
        )
        if trains:
            current.target = target or len(legs)
        return clock.plan_exchange(legs, self.sim.pop, rules), legs

    def _for_device(self, msg: Message, outcome: clock.Outcome) -> Message:
        """The message as this device receives it: its step budget and batch size, if they differ."""
        config = _config(msg)
        changes: dict[str, Any] = {}
        if outcome.partial:
            changes[keys.CFG_STEP_BUDGET] = outcome.steps
        batch = int(self.sim.batches[outcome.device])
        if keys.CFG_BATCH_SIZE in config and batch != int(config[keys.CFG_BATCH_SIZE]):
            changes[keys.CFG_BATCH_SIZE] = batch
        if not changes:
            return msg
        content = RecordDict({name: record for name, record in msg.content.items()})
        content[keys.REC_CONFIG] = ConfigRecord({**config, **changes})
        return Message(
            content,
            dst_node_id=msg.metadata.dst_node_id,
            message_type=msg.metadata.message_type,
            group_id=msg.metadata.group_id,
        )


def _config(msg: Message) -> dict[str, Any]:
    """The message's ``config`` record as a plain dict (empty when absent)."""
    return dict(msg.content.config_records.get(keys.REC_CONFIG, ConfigRecord()))


def _array_bytes(content: RecordDict) -> int:
    return sum(rec.count_bytes() for rec in content.array_records.values())


def partitions_by_query(cfg: Any) -> PartitionQuery:
    """A partition query bound to the run config (the loop's own query message)."""
    from fedge.server.loop import query_partitions

    def query(grid: Grid, nodes: Sequence[int]) -> dict[int, int]:
        return query_partitions(grid, nodes, cfg)

    return query
