"""The apps under `flwr run . local`: Flower's local simulation SuperLink and its Ray engine."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from simulations.localnet import (
    local_superlink_command,
    start_listening,
    wait_healthy,
)
from tests.server.engines import (
    REPO,
    engine_env,
    new_marker,
    rows,
    run_config,
    stop_module_processes,
)

MARKER = new_marker()


def _env(flwr_home: Path, model: Path) -> dict[str, str]:
    return engine_env(flwr_home, model, MARKER)


@pytest.fixture(autouse=True)
def _cleanup():  # type: ignore[no-untyped-def]
    yield
    stop_module_processes(MARKER)


def test_flwr_run_local_simulation_reuses_the_cached_model(micro_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`flwr run . local` with 3 supernodes, 2 rounds: completes; each actor loads the base model once.

    The local simulation SuperLink runs on this test's own port and FLWR_HOME (Flower's fixed
    port would reuse any SuperLink already listening there). The test starts it, as `flwr run`
    would, and waits until it is healthy (`flwr run` gives it a fixed 15 s, too short on a
    loaded machine); `flwr run` then finds it there, and it is stopped by pid afterwards.
    """
    run_dir = tmp_path / "run"
    home = tmp_path / "flwr"
    env = _env(home, micro_zoo.target_dir)
    superlink, http = start_listening(
        lambda port: local_superlink_command(port, home), tmp_path / "superlink.log", env=env
    )
    try:
        wait_healthy(http)
        cmd = [
            "flwr",
            "run",
            str(REPO),
            "local",
            "--stream",
            "--federation-config",
            "num-supernodes=3",
            "--run-config",
            run_config(run_dir, micro_zoo.target_dir, 2),
        ]
        out = subprocess.run(
            cmd,
            env={**env, "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http)},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=420,
            check=False,
        )
        assert superlink.poll() is None  # ours served the run: `flwr run` started none
    finally:
        superlink.terminate()  # the SuperLink outlives a run: stopped by pid
        superlink.wait(timeout=30)
        stop_module_processes(MARKER)
    log = out.stdout[-3000:] + out.stderr[-3000:]
    assert "Starting local SuperLink" not in out.stdout, log
    assert (run_dir / "status.json").is_file(), log
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    trained = [r for r in rows(run_dir) if r["round"] != 0]
    assert [r["clients_succeeded"] for r in trained] == [3, 3]
    assert all(r["model_loads_max"] == 1 for r in trained)
    assert max(float(r["worker_calls_max"]) for r in trained) >= 3  # one actor served several calls
    assert (run_dir / "final" / "adapter" / "adapter_config.json").is_file()
    with socket.socket() as probe:  # nothing left on its port
        assert probe.connect_ex(("127.0.0.1", http)) != 0
