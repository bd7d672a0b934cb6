"""`flwr run ... local`: the fedge app and examples/flower-app on Flower's local simulation.

One simulation SuperLink serves both runs. The test module starts it on its own port and
FLWR_HOME (Flower's fixed port would reuse any SuperLink already listening there) and waits
until it is healthy (`flwr run` gives the one it starts a fixed 15 s, too short on a loaded
machine); `flwr run` finds it on ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``, and the module stops
it by pid afterwards.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from clients.privacy.ledger import STATE_DIR_ENV
from simulations.localnet import local_superlink_command, start_listening, wait_healthy
from tests.server.engines import (
    REPO,
    engine_env,
    metrics_rows,
    short_run_config,
    stop_engine_processes,
)

EXAMPLE = REPO / "examples" / "flower-app"


@dataclass(frozen=True)
class LocalSuperLink:
    """A running simulation SuperLink: the environment `flwr run` needs to find it."""

    process: subprocess.Popen[bytes]
    env: dict[str, str]

    def run(self, app: Path, *args: str) -> subprocess.CompletedProcess[str]:
        """`flwr run APP local --stream ARGS` against this SuperLink."""
        cmd = ["flwr", "run", str(app), "local", "--stream", *args]
        out = subprocess.run(
            cmd, env=self.env, cwd=app, capture_output=True, text=True, timeout=420, check=False
        )
        assert self.process.poll() is None  # ours served the run: `flwr run` started none
        assert "Starting local SuperLink" not in out.stdout, out.stdout[-3000:]
        return out


@pytest.fixture(scope="module")
def superlink(micro_zoo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSuperLink]:  # type: ignore[no-untyped-def]
    """One simulation SuperLink for the module; its apps inherit its environment (the nodes'
    model root, and a privacy state directory for the example's SecAgg+ identities)."""
    root = tmp_path_factory.mktemp("flwr-local")
    env = {
        **engine_env(root / "flwr", micro_zoo.target_dir),
        STATE_DIR_ENV: str(root / "privacy-state"),
    }
    process, http = start_listening(
        lambda port: local_superlink_command(port, root / "flwr"), root / "superlink.log", env=env
    )
    try:
        wait_healthy(http)
        yield LocalSuperLink(process, {**env, "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http)})
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
    directory the SuperLink passed on), so the masked protocol ran, not a plain fallback."""
    # Prepare
    model = tmp_path / "final_model.pt"
    config = f"strategy='scaffold-secagg' num-server-rounds=3 final-model='{model}'"
    # Execute
    out = superlink.run(EXAMPLE, "--federation-config", "num-supernodes=4", "--run-config", config)
    # Assert
    assert model.is_file(), out.stdout[-3000:] + out.stderr[-3000:]
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
