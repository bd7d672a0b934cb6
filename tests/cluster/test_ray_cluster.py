"""SCAFFOLD across a real two-node Ray cluster on loopback, client state reused between rounds.

Not part of `make test` (about a minute: two `ray start`s and a federation on them): run it
with `make test-cluster` (``pytest -m cluster tests/cluster``). Every process it starts
carries a marker in its environment and is stopped by pid, never with `ray stop` (which
would stop every Ray on the machine).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedge.names import STATE
from fedge.simulations.localnet import head_port, ray_node_command, stop_marked

pytestmark = pytest.mark.cluster

BIN = Path(sys.executable).parent
MARKER_VAR, MARKER = "FEDGE_TEST_MARKER", f"fedge-ray-cluster-{uuid.uuid4().hex}"
ROUNDS = 2


def _wait_cpus(address: str, env: dict[str, str], cpus: float, timeout: float = 180) -> None:
    """Poll `ray status` until the cluster reports ``cpus`` CPUs (both nodes joined)."""
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        status = subprocess.run(
            [str(BIN / "ray"), "status", f"--address={address}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out = status.stdout + status.stderr
        if f"/{cpus:.1f} CPU" in out:
            return
        time.sleep(2)
    raise TimeoutError(f"the cluster never reported {cpus} CPUs:\n{out[-2000:]}")


@pytest.fixture
def cluster() -> Iterator[tuple[str, dict[str, str], list[Path]]]:
    """A head and a second node on 127.0.0.1 (temp dirs short: Ray's socket paths are limited)."""
    temps = [
        Path(tempfile.mkdtemp(prefix="frh", dir="/tmp")),
        Path(tempfile.mkdtemp(prefix="frw", dir="/tmp")),
        Path(tempfile.mkdtemp(prefix="frs", dir="/tmp")),  # the storage both nodes see
    ]
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        MARKER_VAR: MARKER,
        STATE.env: str(temps[2]),  # each node's state root (a node sets its own on a cluster)
    }
    env.pop("RAY_ADDRESS", None)
    head_cmd = ray_node_command(temps[0])
    port = head_port(head_cmd)
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                head_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        address = f"127.0.0.1:{port}"
        _wait_cpus(address, env, 1.0)
        procs.append(
            subprocess.Popen(
                ray_node_command(temps[1], head_port=port),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait_cpus(address, env, 2.0)
        yield address, env, temps
    finally:
        for proc in procs:  # `ray start --block` stops its node's processes when terminated
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        stop_marked(MARKER_VAR, MARKER)
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)


def test_scaffold_runs_across_two_ray_nodes_and_reuses_client_state(
    cluster: tuple[str, dict[str, str], list[Path]], tmp_path: Path
) -> None:
    """`RAY_ADDRESS=<head> fedge simulate quick --strategy scaffold` with `client-state-dir` on
    storage both nodes see: the run completes; ClientApp workers ran on both nodes; and every
    client loaded its round-1 control c_i in round 2. The last is read from SCAFFOLD's
    invariant: with reuse, the mean of the clients' stored c_i after a round equals the
    server's c in that round's checkpoint (all N clients take part); a client that started
    round 2 from zeros would leave that mean short by its round-1 c_i / N. RUN with clients
    that never find their state (``DiskStore.load`` returning None, in-process engine): round
    2's mean missed c by 0.5 of c's scale, against the bound 1e-4."""
    # Prepare
    address, env, temps = cluster
    run_dir, shared = tmp_path / "run", Path(env[STATE.env]) / "shared-state"
    cmd = [
        str(BIN / "fedge"),
        "simulate",
        "quick",
        "--strategy",
        "scaffold",
        "--rounds",
        str(ROUNDS),
        "--out",
        str(run_dir),
        "--set",
        f"client-state-dir={shared}",
        "--set",
        "save-merged=false",
    ]
    # Execute
    out = subprocess.run(
        cmd,
        env={**env, "RAY_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    # Assert: the run completed on the cluster
    log = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, log
    assert '"completed"' in (run_dir / "status.json").read_text(), log
    # Assert: both nodes ran Ray workers (each node writes its workers' logs under its temp dir)
    for temp in temps[:2]:
        assert list(temp.glob("session_*/logs/worker-*")), (
            f"no Ray worker ran on the node of {temp}"
        )
    # Assert: every partition kept a control per round on the shared storage, and reused it
    (run_root,) = shared.iterdir()
    partitions = sorted(run_root.iterdir())
    assert len(partitions) == 3
    for server_round in range(1, ROUNDS + 1):
        with np.load(run_dir / "checkpoints" / f"round_{server_round:04d}" / "state.npz") as ckpt:
            c = {k.split("ctrl/", 1)[1]: ckpt[k] for k in ckpt.files if "ctrl/" in k}
        stored = [dict(np.load(p / f"round_{server_round}.npz")) for p in partitions]
        scale = max(float(np.abs(v).max()) for v in c.values())
        assert scale > 0, f"round {server_round}: the server's control is all zeros"
        for name, value in c.items():  # a tensor of c may be zero (lora_A before B moves)
            mean = np.mean([s[name] for s in stored], axis=0)
            assert float(np.abs(mean - value).max()) <= 1e-4 * scale, (server_round, name)
