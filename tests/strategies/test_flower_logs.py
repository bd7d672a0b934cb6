"""fedge's log lines reach Flower's log, once, and Flower's "Received N results" line stays.

Before fedge/logs.py, fedge's strategies logged to ``fedge.*`` loggers with no handler: in a
Flower ServerApp their INFO lines (settings) went nowhere, their warnings (rejected replies)
only to Python's last-resort stderr handler, never through Flower's logger (so never to
``flwr run --stream``), and fedge's ``aggregate_train`` dropped Flower FedAvg's line
"aggregate_train: Received N results and M failures".
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from flwr.common.logger import ConsoleHandler

from fedge.logs import PREFIX
from fedge.server.privacy.strategy import CentralDP
from fedge.strategies.base import NoReplyAccepted
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.scaffold import Scaffold
from tests.strategies.test_flower_native import NODES, SAMPLING, _fedge_client, _flower_client, _run


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def flower_log() -> tuple[Collect, io.StringIO]:
    """A collector and a Flower console handler (Flower's format, no colour) on ``flwr``."""
    flower = logging.getLogger("flwr")
    collect, text = Collect(), io.StringIO()
    console = ConsoleHandler(colored=False, stream=text)
    console.setLevel(logging.INFO)
    flower.addHandler(collect)
    flower.addHandler(console)
    yield collect, text
    flower.removeHandler(collect)
    flower.removeHandler(console)


def test_rejections_and_settings_print_once_through_flowers_logger(
    tmp_path: Path, flower_log: tuple[Collect, io.StringIO], caplog: pytest.LogCaptureFixture
) -> None:
    """SCAFFOLD on a plain Flower client refuses every reply: each refusal is one Flower log
    line with fedge's prefix, and the root logger (pytest's caplog) gets it once, unprefixed."""
    collect, text = flower_log
    caplog.set_level(logging.INFO)
    with pytest.raises(NoReplyAccepted):  # no reply accepted: the run ends with the error
        _run(Scaffold(**SAMPLING), _flower_client(), tmp_path, rounds=1)
    lines = text.getvalue().splitlines()
    rejected = [line for line in lines if "rejected the reply of node" in line]
    assert len(rejected) == NODES, lines
    assert all(line.startswith("WARNING :") and f" {PREFIX}round 1:" in line for line in rejected)
    assert sum(f"{PREFIX}fedge scaffold:" in line for line in lines) == 1  # summary(), INFO
    assert "aggregate_train: Received 4 results and 0 failures" in text.getvalue()
    assert sum("rejected the reply" in r.getMessage() for r in collect.records) == NODES
    at_root = [r.getMessage() for r in caplog.records if "rejected the reply" in r.getMessage()]
    assert len(at_root) == NODES and not any(m.startswith(PREFIX) for m in at_root)
    assert {r.name for r in collect.records if PREFIX in r.getMessage()} >= {
        "fedge.strategies.base"
    }


def test_flowers_level_is_respected(
    tmp_path: Path, flower_log: tuple[Collect, io.StringIO]
) -> None:
    """``flwr`` at WARNING (as FLWR_LOG_LEVEL or the demo set it) drops fedge's INFO lines."""
    collect, _ = flower_log
    flower = logging.getLogger("flwr")
    level = flower.level
    flower.setLevel(logging.WARNING)
    try:
        _run(FedAvg(**SAMPLING), _fedge_client(), tmp_path, rounds=1)
    finally:
        flower.setLevel(level)
    assert not [r for r in collect.records if r.levelno < logging.WARNING]


def test_central_dp_keeps_flowers_received_line(
    tmp_path: Path, flower_log: tuple[Collect, io.StringIO]
) -> None:
    """CentralDP reads the replies itself too: Flower's line is there once per round, and its
    epsilon line reaches Flower's log with fedge's prefix."""
    _, text = flower_log
    _run(
        CentralDP(FedAvg(**SAMPLING), noise_multiplier=1.0, clip=0.5), _fedge_client(), tmp_path, 2
    )
    log = text.getvalue()
    assert log.count("aggregate_train: Received 4 results and 0 failures") == 2, log[-3000:]
    assert f"{PREFIX}round 2:" in log, log[-3000:]
