"""The same apps under `flwr run ... local` (Flower's local simulation) and under the Deployment
Engine (a real SuperLink and SuperNodes), the fedge app and examples/flower-app.

One simulation SuperLink and one Ray head serve both `flwr run` tests. The module starts the
Ray head itself (:func:`fedge.simulations.localnet.ray_head`: its own temp dir and ports, 2 CPUs, so
one ClientApp actor at Flower's default 2 CPUs each) and retries it when it overruns Ray's
fixed 30 s node start-up window, which a loaded machine does (two fleets' Ray clusters run
beside this file in the suite); Flower's Ray backend joins it through ``RAY_ADDRESS``
(`ray.init()` reads it) instead of starting a cluster per run, and each run checks that its
driver joined this head. The module starts the SuperLink on its own port and FLWR_HOME
(Flower's fixed port would reuse any SuperLink already listening there) and waits until it
is healthy (`flwr run` gives the one it starts a fixed 15 s, too short on a loaded machine);
`flwr run` finds it on ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``. Both are stopped by pid
afterwards, never with `ray stop`. The three runs stay in one file, one after another: each
starts a Ray driver or a dozen processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.simulations.localnet import (
    RayHead,
    local_superlink_command,
    ray_head,
    start_listening,
    stop_marked,
    superlink_command,
    supernode_command,
    wait_healthy,
    write_flwr_home,
)

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARKER = f"fedge-engine-test-{uuid.uuid4().hex}"  # inherited by every process these tests start


def engine_env(flwr_home: Path, model: Path) -> dict[str, str]:
    """The processes' environment; the nodes' model root holds the run's model (the server
    names it by its directory name, each node resolves it under its own root)."""
    return {
        **os.environ,
        "FEDGE_MODEL_ROOT": str(model.resolve().parent),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "FLWR_HOME": str(flwr_home),
        "FEDGE_TEST_MARKER": MARKER,
    }


def stop_engine_processes() -> None:
    """Stop, by pid, every process started with this module's marker (SuperLink, SuperNodes, apps)."""
    stop_marked("FEDGE_TEST_MARKER", MARKER)


def short_run_config(run_dir: Path, model: Path, rounds: int) -> str:
    """A short run: the engines are under test, not the training (the defaults train longer)."""
    return (
        f"run-dir='{run_dir}' num-server-rounds={rounds} model='{model}' client-eval=false "
        "server-eval-batches=4 local-steps=2 batch-size=4 seq-len=64"
    )


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl, one dict per round."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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

    def supernodes(**partitions: int) -> None:
        """Start one SuperNode per name at once (each start waits for its own port)."""
        with ThreadPoolExecutor(len(partitions)) as pool:
            for done in [
                pool.submit(
                    spawn, name, partial(supernode_command, link, partition=p, partitions=3)
                )
                for name, p in partitions.items()
            ]:
                done.result()

    link = spawn("superlink", lambda port: superlink_command(port, tmp_path / "state.db"))
    write_flwr_home(home, link)
    supernodes(a=0, b=1)
    run_dir = tmp_path / "run"
    run_config = short_run_config(run_dir, micro_zoo.target_dir, 3) + " min-train-nodes=1"
    cmd = ["flwr", "run", str(REPO), "dep", "--stream", "--run-config", run_config]
    with (logs / "flwr-run.log").open("wb") as fh:
        run = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        _wait_round(run_dir, 1, run)
        started["b"].terminate()  # B leaves (stopped by pid) ...
        started["b"].wait(timeout=30)
        supernodes(c=2, **{"b-again": 1})  # ... C joins, and B comes back under a new node id
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
    later = {p for r in rows[2:] for p in r["partitions_trained"]}
    assert {0, 1, 2} <= later, [r["partitions_trained"] for r in rows]
    assert (run_dir / "final" / "merged" / "config.json").is_file()
    for proc in started.values():
        assert proc.poll() is not None


EXAMPLE = REPO / "examples" / "flower-app"


RAY_CPUS = 2  # one ClientApp actor (Flower gives each 2 CPUs): one model load serves every call


@dataclass(frozen=True)
class LocalSuperLink:
    """A running simulation SuperLink: the environment `flwr run` needs to find it, and the Ray
    head its simulations join."""

    process: subprocess.Popen[bytes]
    env: dict[str, str]
    ray: RayHead

    def run(self, app: Path, *args: str) -> subprocess.CompletedProcess[str]:
        """`flwr run APP local --stream ARGS` against this SuperLink and its Ray head."""
        drivers = set(self.ray.logs.glob("python-core-driver-*"))
        cmd = ["flwr", "run", str(app), "local", "--stream", *args]
        out = subprocess.run(
            cmd, env=self.env, cwd=app, capture_output=True, text=True, timeout=420, check=False
        )
        assert self.process.poll() is None  # ours served the run: `flwr run` started none
        assert "Starting local SuperLink" not in out.stdout, out.stdout[-3000:]
        joined = set(self.ray.logs.glob("python-core-driver-*")) - drivers
        assert len(joined) == 1, (joined, out.stdout[-3000:])  # its simulation joined our head
        return out


@pytest.fixture(scope="module")
def superlink(micro_zoo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSuperLink]:  # type: ignore[no-untyped-def]
    """One Ray head and one simulation SuperLink for the module; its apps inherit their
    environment (the nodes' model root, and a privacy state directory for the example's
    SecAgg+ identities): the ClientApp actors run in the head's workers, which inherit the
    head's environment, so the head gets the same one (without the module's marker: it is
    stopped by its own, after the SuperLink)."""
    root = tmp_path_factory.mktemp("flwr-local")
    env = {
        **engine_env(root / "flwr", micro_zoo.target_dir),
        STATE_DIR_ENV: str(root / "privacy-state"),
    }
    head_env = {k: v for k, v in env.items() if k != "FEDGE_TEST_MARKER"}
    with ray_head(head_env, root / "ray.log", RAY_CPUS, extra=("--no-monitor",)) as head:
        env["RAY_ADDRESS"] = head.address
        process, http = start_listening(
            lambda port: local_superlink_command(port, root / "flwr"),
            root / "superlink.log",
            env=env,
        )
        try:
            wait_healthy(http)
            yield LocalSuperLink(
                process, {**env, "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http)}, head
            )
        finally:
            process.terminate()  # the SuperLink outlives a run: stopped by pid
            process.wait(timeout=30)
            stop_engine_processes()
    with socket.socket() as probe:  # nothing left on its port
        assert probe.connect_ex(("127.0.0.1", http)) != 0


def test_flwr_run_local_simulation_reuses_the_cached_model(
    superlink: LocalSuperLink, micro_zoo, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """`flwr run . local` with 3 supernodes, 2 rounds: completes; each actor loads the base model once."""
    run_dir = tmp_path / "run"
    config = short_run_config(run_dir, micro_zoo.target_dir, 2)
    out = superlink.run(REPO, "--federation-config", "num-supernodes=3", "--run-config", config)
    log = out.stdout[-3000:] + out.stderr[-3000:]
    assert (run_dir / "status.json").is_file(), log
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    trained = [r for r in metrics_rows(run_dir) if r["round"] != 0]
    assert [r["clients_succeeded"] for r in trained] == [3, 3]
    assert all(r["model_loads_max"] == 1 for r in trained)
    assert max(float(r["worker_calls_max"]) for r in trained) >= 3  # one actor served several calls
    assert (run_dir / "final" / "adapter" / "adapter_config.json").is_file()


def test_the_flower_app_example_runs_scaffold_under_secagg_with_flwr_run(
    superlink: LocalSuperLink, tmp_path: Path
) -> None:
    """examples/flower-app as its README runs it, `strategy="scaffold-secagg"`, 4 SuperNodes on
    Flower's Ray simulation: the run ends, its final model beats the initial one on the nodes'
    data, and each node advertised a SecAgg+ identity (its signing key, under the privacy state
    directory the SuperLink passed on), so the masked protocol ran, not a plain fallback. The
    ``--stream`` output carries fedge's lines (before fedge/logs.py: none) and Flower's
    "Received N results" line once per round (before: none, fedge's strategy reads replies)."""
    # Prepare
    model = tmp_path / "final_model.pt"
    config = f"strategy='scaffold-secagg' num-server-rounds=3 final-model='{model}'"
    # Execute
    out = superlink.run(EXAMPLE, "--federation-config", "num-supernodes=4", "--run-config", config)
    # Assert
    assert model.is_file(), out.stdout[-3000:] + out.stderr[-3000:]
    # fedge's lines reach `flwr run --stream` through Flower's logger (fedge/logs.py), and
    # Flower's own per-round line is there for the replies fedge's strategy reads
    assert "fedge: fedge SecAgg+ around Scaffold" in out.stdout, out.stdout[-3000:]
    assert out.stdout.count("aggregate_train: Received 4 results and 0 failures") == 3
    sys.path.insert(0, str(EXAMPLE))
    try:
        from flowerapp import task
    finally:
        sys.path.remove(str(EXAMPLE))
    torch.manual_seed(0)
    initial, final = task.Net(), task.Net()
    final.load_state_dict(torch.load(model))
    nodes = range(4)
    before = sum(task.evaluate(initial, *task.load_data(p, 4))[1] for p in nodes) / 4
    after = sum(task.evaluate(final, *task.load_data(p, 4))[1] for p in nodes) / 4
    assert after > before + 0.2, (before, after)
    identities = Path(superlink.env[STATE_DIR_ENV]) / "secagg-identity"
    assert sorted(key.name for key in identities.glob("*.key")) == [
        f"partition-{p:05d}.key" for p in nodes
    ]


EXAMPLE_DP = REPO / "examples" / "flower-dp"


def test_the_flower_dp_example_runs_distributed_dp_with_flwr_run(
    superlink: LocalSuperLink, tmp_path: Path
) -> None:
    """examples/flower-dp as its README runs it, `privacy="distributed"` (SecAggPlus with
    DistributedDP), 4 SuperNodes on Flower's Ray simulation, 2 rounds at z = 0.5: the run
    ends with a model, and the Result's train metrics hold each round's epsilon, that of r
    Gaussian releases (RDP, delta 1e-5)."""
    from fedge.privacy.accounting import gaussian_epsilon

    # Prepare
    out = tmp_path / "out"
    config = f"privacy='distributed' noise-multiplier=0.5 num-server-rounds=2 out-dir='{out}'"
    # Execute
    run = superlink.run(
        EXAMPLE_DP, "--federation-config", "num-supernodes=4", "--run-config", config
    )
    # Assert
    log = run.stdout[-3000:] + run.stderr[-3000:]
    assert (out / "final_model.pt").is_file(), log
    metrics = json.loads((out / "train_metrics.json").read_text())
    for r in (1, 2):
        expected = gaussian_epsilon([0.5] * r, 1e-5, "rdp")
        assert metrics[str(r)]["dp-epsilon"] == pytest.approx(expected), log
