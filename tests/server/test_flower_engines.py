"""The same apps under `flwr run .` (local simulation) and under the Deployment Engine (real processes)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARKER = f"fedge-engine-test-{uuid.uuid4().hex}"  # inherited by every process these tests start


def _env(flwr_home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "FLWR_HOME": str(flwr_home),
        "FEDGE_TEST_MARKER": MARKER,
    }


def _stop_marked() -> None:
    """Stop, by pid, every process started with this module's marker (SuperLink, SuperNodes, apps)."""
    me = os.getpid()
    procs = []
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != me and p.environ().get("FEDGE_TEST_MARKER") == MARKER:
                procs.append(p)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


@pytest.fixture(autouse=True)
def _cleanup():  # type: ignore[no-untyped-def]
    yield
    _stop_marked()


def _run_config(run_dir: Path, model: Path, rounds: int) -> str:
    return f"run-dir='{run_dir}' num-server-rounds={rounds} model='{model}' client-eval=false server-eval-batches=4"


def _rows(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_flwr_run_local_simulation_reuses_the_cached_model(micro_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`flwr run . local` with 3 supernodes, 2 rounds: completes; each actor loads the base model once."""
    run_dir = tmp_path / "run"
    cmd = [
        "flwr",
        "run",
        str(REPO),
        "local",
        "--stream",
        "--federation-config",
        "num-supernodes=3",
        "--run-config",
        _run_config(run_dir, micro_zoo.target_dir, 2),
    ]
    out = subprocess.run(
        cmd,
        env=_env(tmp_path / "flwr"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert (run_dir / "status.json").is_file(), out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    trained = [r for r in _rows(run_dir) if r["round"] != 0]
    assert [r["clients_succeeded"] for r in trained] == [3, 3]
    assert all(r["model_loads_max"] == 1 for r in trained)
    assert max(float(r["worker_calls_max"]) for r in trained) >= 3  # one actor served several calls
    assert (run_dir / "final" / "adapter" / "adapter_config.json").is_file()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def test_deployment_engine_superlink_and_two_supernodes(micro_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A real flower-superlink and two flower-supernodes on 127.0.0.1 run two rounds of the federation."""
    link, node0, node1 = _free_ports(3)
    home = tmp_path / "flwr"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "dep"\n\n[superlink.dep]\naddress = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    env = _env(home)
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, *args: str) -> None:
        with (logs / f"{name}.log").open("wb") as fh:
            started.append(
                subprocess.Popen(
                    list(args), env=env, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT
                )
            )

    spawn(
        "superlink",
        "flower-superlink",
        "--insecure",
        "--host",
        "127.0.0.1",
        "--port",
        str(link),
        "--database",
        str(tmp_path / "state.db"),
    )
    _wait_port(link)
    for pid_, port in ((0, node0), (1, node1)):
        spawn(
            f"supernode{pid_}",
            "flower-supernode",
            "--insecure",
            "--superlink",
            f"127.0.0.1:{link}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--node-config",
            f"partition-id={pid_} num-partitions=2",
        )
    run_dir = tmp_path / "run"
    cmd = [
        "flwr",
        "run",
        str(REPO),
        "dep",
        "--stream",
        "--run-config",
        _run_config(run_dir, micro_zoo.target_dir, 2),
    ]
    try:
        subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, timeout=480, check=False)
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
            and json.loads((run_dir / "status.json").read_text())["status"] == "running"
        ):
            time.sleep(1)
    finally:
        for proc in started:  # stop what we started, by pid; their app processes carry the marker
            proc.terminate()
        for proc in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        _stop_marked()
    log_tail = "".join((logs / n).read_text()[-1500:] for n in ("superlink.log", "supernode0.log"))
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed", status["message"] + log_tail
    rows = _rows(run_dir)
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["clients_succeeded"] == 2 and r["clients_rejected"] == 0 for r in rows[1:])
    assert (run_dir / "final" / "merged" / "config.json").is_file()
    for proc in started:
        assert proc.poll() is not None
