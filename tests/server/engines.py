"""What the engine tests share: a marker per test module, the processes' environment, short runs."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from simulations.localnet import stop_marked

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARKER_KEY = "FEDGE_TEST_MARKER"


def new_marker() -> str:
    """A marker for one test module: every process its tests start inherits it, so the module
    stops exactly its own (modules run side by side in other xdist workers)."""
    return f"fedge-engine-test-{uuid.uuid4().hex}"


def engine_env(flwr_home: Path, model: Path, marker: str) -> dict[str, str]:
    """The processes' environment; the nodes' model root holds the run's model (the server
    names it by its directory name, each node resolves it under its own root)."""
    return {
        **os.environ,
        "FEDGE_MODEL_ROOT": str(model.resolve().parent),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "FLWR_HOME": str(flwr_home),
        MARKER_KEY: marker,
    }


def stop_module_processes(marker: str) -> None:
    """Stop, by pid, every process started with ``marker`` (SuperLink, SuperNodes, apps)."""
    stop_marked(MARKER_KEY, marker)


def run_config(run_dir: Path, model: Path, rounds: int) -> str:
    """A short run: the engines are under test, not the training (the defaults train longer)."""
    return (
        f"run-dir='{run_dir}' num-server-rounds={rounds} model='{model}' client-eval=false "
        "server-eval-batches=4 local-steps=2 batch-size=4 seq-len=64"
    )


def rows(run_dir: Path) -> list[dict[str, object]]:
    """The run's metrics rows."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
