"""What the `flwr run` and Deployment Engine tests share: the processes' environment, their
cleanup by marker, a short run config and the run's metrics rows."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from simulations.localnet import stop_marked

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
    """Stop, by pid, every process started with this worker's marker (SuperLink, SuperNodes, apps)."""
    stop_marked("FEDGE_TEST_MARKER", MARKER)


def short_run_config(run_dir: Path, model: Path, rounds: int) -> str:
    """A short run: the engines are under test, not the training (the defaults train longer)."""
    return (
        f"run-dir='{run_dir}' num-server-rounds={rounds} model='{model}' client-eval=false "
        "server-eval-batches=4 local-steps=2 batch-size=4 seq-len=64"
    )


def metrics_rows(run_dir: Path) -> list[dict[str, object]]:
    """The run's metrics.jsonl, one dict per round."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
