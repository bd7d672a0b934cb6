"""A Grid wrapper that passes every reply through one hook, for wrappers that inspect or edit replies."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run


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
