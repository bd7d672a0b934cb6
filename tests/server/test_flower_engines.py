"""The fedge app under the Deployment Engine: a real SuperLink and SuperNodes, nodes leaving,
joining and reconnecting mid-run (`flwr run` on the local simulation: tests/server/test_flwr_run.py)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from simulations.localnet import (
    start_listening,
    superlink_command,
    supernode_command,
    write_flwr_home,
)
from tests.server.engines import (
    REPO,
    engine_env,
    metrics_rows,
    short_run_config,
    stop_engine_processes,
)


@pytest.fixture(autouse=True)
def _cleanup():  # type: ignore[no-untyped-def]
    yield
    stop_engine_processes()


def _wait_round(run_dir: Path, server_round: int, proc: subprocess.Popen[bytes]) -> None:
    """Poll metrics.jsonl until ``server_round`` has a row (or the run ended)."""
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline and proc.poll() is None:
        rows = metrics_rows(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        if any(r["round"] == server_round for r in rows):
            return
        time.sleep(0.5)
    raise AssertionError(f"round {server_round} never finished")


def test_deployment_engine_with_nodes_leaving_joining_and_reconnecting(
    micro_zoo, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Real flower-superlink + flower-supernodes on 127.0.0.1; membership changes mid-run.

    Nodes A (partition 0) and B (1) train round 1. Then B is stopped by pid, C (2) joins and
    B restarts under a new node id. The run completes, and later rounds train partition 2
    and partition 1 again (B's old process is dead, so that is the reconnected node).
    """
    home = tmp_path / "flwr"
    logs = tmp_path / "logs"
    logs.mkdir()
    started: dict[str, subprocess.Popen[bytes]] = {}
    env = engine_env(home, micro_zoo.target_dir)

    def spawn(name: str, command: Callable[[int], list[str]]) -> int:
        """Start `command(port)` on a free port (retried if taken first); returns the port."""
        started[name], port = start_listening(command, logs / f"{name}.log", env=env, cwd=tmp_path)
        return port

    def supernode(name: str, partition: int) -> None:
        spawn(name, lambda port: supernode_command(link, port, partition, 3))

    link = spawn("superlink", lambda port: superlink_command(port, tmp_path / "state.db"))
    write_flwr_home(home, link)
    supernode("a", 0)
    supernode("b", 1)
    run_dir = tmp_path / "run"
    run_config = short_run_config(run_dir, micro_zoo.target_dir, 3) + " min-train-nodes=1"
    cmd = ["flwr", "run", str(REPO), "dep", "--stream", "--run-config", run_config]
    with (logs / "flwr-run.log").open("wb") as fh:
        run = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        _wait_round(run_dir, 1, run)
        started["b"].terminate()  # B leaves (stopped by pid) ...
        started["b"].wait(timeout=30)
        supernode("c", 2)  # ... C joins, and B comes back under a new node id
        supernode("b-again", 1)
        run.wait(timeout=480)
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
            and json.loads((run_dir / "status.json").read_text())["status"] == "running"
        ):
            time.sleep(1)
    finally:
        for proc in [run, *started.values()]:  # stop what we started, by pid
            proc.terminate()
        for proc in [run, *started.values()]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        stop_engine_processes()
    log_tail = "".join((logs / n).read_text()[-1500:] for n in ("superlink.log", "a.log"))
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed", status["message"] + log_tail
    rows = metrics_rows(run_dir)
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["partitions_trained"] == [0, 1]
    later = {p for r in rows[2:] for p in r["partitions_trained"]}  # type: ignore[attr-defined]
    assert {0, 1, 2} <= later, [r["partitions_trained"] for r in rows]
    assert (run_dir / "final" / "merged" / "config.json").is_file()
    for proc in started.values():
        assert proc.poll() is not None
