"""`fedge verifier fleet` as a deployer runs it: Ray locked by a token, a SIGTERM that tears down.

Starts the real command (a one-replica fleet of the micro target) in its own process: about
a minute and a half on two quiet cores, so it runs with `make test-cluster` (-m cluster).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedge.zoo import ZooPaths

pytestmark = pytest.mark.cluster
START_S = 300


def alive(processes: list[psutil.Process]) -> list[str]:
    """Names of those of `processes` still running (a reused pid is another process)."""
    names = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                names.append(" ".join(proc.cmdline()[:2]))
        except psutil.Error:
            continue
    return names


def test_the_fleet_admits_no_tokenless_ray_process_and_a_sigterm_leaves_nothing_running(
    micro_zoo: ZooPaths, tmp_path: Path
) -> None:
    """A process without the fleet's Ray token tries to join its Ray cluster (as an attacker on
    the network would, to read the ingress's admin methods or call a replica's relay): refused.
    Then SIGTERM: the command exits 0 and none of its Ray session's processes is left.

    Before, the GCS took any process (a token-less one joined, read the ingress's `describe()`
    and called the relay naming device-a), and SIGTERM exited by SIGABRT mid-teardown leaving
    Ray's DashboardAgent and RuntimeEnvAgent running (issue 31, findings 6 and 9): ray.init
    had replaced the command's SIGTERM handler with one raising SystemExit anywhere."""
    run_dir = tmp_path / "fleet"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    command = [
        sys.executable, "-c", "from fedge.cli.main import main; main()",
        "verifier", "fleet", "--model", str(micro_zoo.target_dir), "--replicas", "1",
        "--replica-cpus", "0", "--port", "0", "--run-dir", str(run_dir),
    ]  # fmt: skip
    fleet = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert fleet.stdout is not None
        deadline = time.monotonic() + START_S
        line = ""
        while "fleet listening" not in line and time.monotonic() < deadline:
            line = fleet.stdout.readline()
            if not line and fleet.poll() is not None:
                pytest.fail(f"fedge verifier fleet exited {fleet.returncode} before listening")
        state = json.loads((run_dir / "fleet.json").read_text())
        assert Path(state["ray_token_file"]).stat().st_mode & 0o077 == 0
        stranger = subprocess.run(
            [sys.executable, "-c", f"import ray; ray.init(address={state['ray_address']!r})"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert stranger.returncode != 0, stranger.stdout
        ray_processes = psutil.Process(fleet.pid).children(recursive=True)  # GCS, raylet, agents
        assert any("agent" in name.lower() for name in alive(ray_processes)), alive(ray_processes)
        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout=180) == 0
        deadline = time.monotonic() + 30
        while alive(ray_processes) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert alive(ray_processes) == []
    finally:
        if fleet.poll() is None:  # only the process this test started, by its pid
            fleet.kill()
            fleet.wait()
