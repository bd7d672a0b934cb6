"""A Grid wrapper that passes every reply through one hook, for wrappers that inspect or edit replies."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from flwr.app import Message
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.superlink.grid.http_grid import HttpGrid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid


class ReplyHookGrid(Grid):
    """Delegates every call to the wrapped grid; replies come back through ``on_reply``."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def on_reply(self, msg: Message) -> Message:
        """Inspect or edit one reply; the base class returns it unchanged."""
        return msg

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(self, *args, **kwargs) -> Message:  # type: ignore[no-untyped-def]
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        return self._grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.on_reply(m) for m in self._grid.pull_messages(message_ids)]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return [self.on_reply(m) for m in self._grid.send_and_receive(messages, timeout=timeout)]


FIRST_PULL_S = 0.002  # first wait after the push; replies of fast clients arrive within ms
MAX_PULL_S = 0.05  # the backoff's ceiling: a gRPC pull per 50 ms at most
MAX_LOCAL_PULL_S = 0.01  # in simulation a pull is a call on the in-process LinkState: cheap


def exchange_messages(
    grid: Grid, messages: Sequence[Message], timeout: float | None
) -> list[Message]:
    """Send ``messages`` and return their replies (all of them, or those in by ``timeout``).

    Flower's own ``send_and_receive`` sleeps a fixed 0.1 s (simulation) or 3 s (the
    Deployment Engine's HTTP grid) between pulls, which a protocol of several exchanges per
    round pays at every barrier. On those grids (bare, or behind a ``ReplyHookGrid`` that
    only edits replies) this pushes, then pulls after 2 ms, 1.5x longer each time, at most
    50 ms over gRPC and 10 ms in simulation. A grid with its own ``send_and_receive`` (a device simulation, an in-process
    engine) keeps it: the exchange goes through it unchanged.
    """
    if not _polls_like_flower(grid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = set(grid.push_messages(messages))
    deadline = None if timeout is None else time.monotonic() + timeout
    wait, ceiling = FIRST_PULL_S, _pull_ceiling(grid)
    out: list[Message] = []
    while pending:
        replies = list(grid.pull_messages(pending))
        out.extend(replies)
        pending -= {m.metadata.reply_to_message_id for m in replies}
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(wait if deadline is None else min(wait, max(0.0, deadline - time.monotonic())))
        wait = min(ceiling, wait * 1.5)
    return out


def _pull_ceiling(grid: Grid) -> float:
    """The longest wait between pulls: short on the in-process grid, longer over gRPC."""
    while isinstance(grid, ReplyHookGrid):
        grid = grid._grid
    return MAX_LOCAL_PULL_S if isinstance(grid, InMemoryGrid) else MAX_PULL_S


def _polls_like_flower(grid: Grid) -> bool:
    """Whether ``grid.send_and_receive`` is Flower's own fixed-interval polling loop."""
    impl = type(grid).send_and_receive
    if impl is ReplyHookGrid.send_and_receive and isinstance(grid, ReplyHookGrid):
        return _polls_like_flower(grid._grid)
    return impl in (InMemoryGrid.send_and_receive, HttpGrid.send_and_receive)
