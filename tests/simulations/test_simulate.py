"""`fedge simulate` end to end on Flower's simulation engine: artefacts, cache, kill-and-resume, faults."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.numpy import load_file

from fedge.simulations.localnet import wait_for_file
from tests.simulations.federations import simulate_here

FAST = ["--set", "client-eval=false", "--set", "server-eval-batches=4"]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedge.cli", "simulate", *args]


MARKER = f"fedge-test-{uuid.uuid4().hex}"  # inherited by every process a run starts (Ray included)


def _env() -> dict[str, str]:
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "RAY_DEDUP_LOGS": "0", "FEDGE_TEST_MARKER": MARKER}


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cmd(*args), env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _kill_tree(pid: int) -> None:
    """SIGKILL a process we started and every descendant (Ray's GCS, raylet, workers), by pid."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [*root.children(recursive=True), root]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)
    _kill_marked()


def _kill_marked() -> None:
    """Kill, by pid, processes carrying this session's marker that escaped the tree (Ray actors)."""
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != me and p.environ().get("FEDGE_TEST_MARKER") == MARKER:
                p.kill()


def _rows(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _adapter(run: Path) -> dict[str, np.ndarray]:
    return load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))


def test_killed_and_resumed_scaffold_run_ends_with_the_same_adapter(
    micro_zoo, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Uninterrupted run A vs run B killed (SIGKILL) after round 1 and resumed: identical adapters.

    Two rounds: the resumed process runs round 2 from what round 1 left on disk (the server's
    control variate c in the checkpoint, each client's c_i in the client state store), so any
    SCAFFOLD state the resume failed to restore changes the final adapter. B and its resume are
    fresh processes (a kill is a real SIGKILL, and the resume can only read the disk); A is the
    reference, run here through the same command line. Checkpoints and resume live in the
    ServerApp and the client state store, the same on either engine, so all runs use the
    in-process engine; Ray's per-actor model cache is checked under `flwr run`
    (tests/server/test_flower_engines.py) and `fedge simulate` on Ray by the realignment tests.
    """
    common = [
        "quick",
        "--engine",
        "inprocess",
        "--strategy",
        "scaffold",
        "--rounds",
        "2",
        "--set",
        f"model={micro_zoo.target_dir}",
        *FAST,
    ]
    # Execute: A uninterrupted (its merged model is not needed: B's is checked)
    simulate_here([*common, "--set", "save-merged=false", "--out", str(tmp_path / "A")])
    # Execute: B killed once round 1 is checkpointed, then resumed
    proc = subprocess.Popen(
        _cmd(*common, "--out", str(tmp_path / "B")),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = tmp_path / "B" / "checkpoints" / "round_0001" / "meta.json"
    try:
        wait_for_file(marker, proc, timeout=240)
    finally:
        _kill_tree(proc.pid)
    assert marker.is_file(), "run B never checkpointed round 1"
    assert json.loads((tmp_path / "B" / "status.json").read_text())["status"] == "running"
    resumed = _run(["--resume", str(tmp_path / "B")])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    # Assert: same final adapter, same per-round perplexities
    a, b = _adapter(tmp_path / "A"), _adapter(tmp_path / "B")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    rows_a, rows_b = _rows(tmp_path / "A"), _rows(tmp_path / "B")
    assert [r["round"] for r in rows_b] == [0, 1, 2]
    assert [r["perplexity"] for r in rows_a] == [r["perplexity"] for r in rows_b]

    # Assert: the resumed run's directory artefacts, and its process's model cache (one load,
    # every client call of round 2 served by it)
    run = tmp_path / "B"
    for name in ("config.toml", "scenario.toml", "metrics.csv", "perplexity.png", "status.json"):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        f"round_000{i}" for i in range(3)
    ]
    header = (run / "metrics.csv").read_text().splitlines()[0]
    for column in (
        "perplexity",
        "clients_sampled",
        "clients_succeeded",
        "bytes_up",
        "bytes_down",
        "round_seconds",
    ):
        assert column in header
    last = rows_b[-1]
    assert last["model_loads_max"] == 1
    assert float(last["worker_calls_max"]) >= 3  # the cached model served several calls
    assert all(int(r["bytes_up"]) > 0 for r in rows_b if r["round"] != 0)

    # Assert: the peft adapter loads, and the merged model computes the same logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fedge.models import load_causal_lm

    peft_model = PeftModel.from_pretrained(
        load_causal_lm(micro_zoo.target_dir), str(run / "final" / "adapter")
    ).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(run / "final" / "merged")).eval()
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4, rtol=1e-4
        )


def test_malformed_replies_fail_a_round_below_minimum_and_the_run_resumes(
    micro_zoo, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Faults on 2 of 3 clients with min-train-nodes 2: round 1 fails naming both; resumed with one fault it succeeds.

    The server's checks are the same on either engine: this runs `fedge simulate` in process on
    the in-process engine (no Ray start; the kill-and-resume test above covers Ray).
    """
    from typer.testing import CliRunner

    from fedge.simulations.cli import app

    run = tmp_path / "faulty"
    faults = ["--set", "client-mods=fedge.clients.faults:fault_mod", "--set", "min-train-nodes=2"]
    failed = CliRunner().invoke(
        app,
        [
            "quick",
            "--engine",
            "inprocess",
            "--rounds",
            "1",
            "--out",
            str(run),
            "--set",
            f"model={micro_zoo.target_dir}",
            *FAST,
            *faults,
            "--set",
            "x-fault-partitions=1:nan,2:missing",
        ],
    )
    assert failed.exit_code == 1, failed.output[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed"
    assert "min-train-nodes is 2" in status["message"] and "--resume" in status["message"]
    assert "NaN or Inf" in status["message"] and "missing" in status["message"]
    assert "node " in status["message"]  # each rejection names its node id
    assert (run / "checkpoints" / "round_0000").is_dir()

    resumed = CliRunner().invoke(
        app, ["--resume", str(run), "--engine", "inprocess", "--set", "x-fault-partitions=2:dtype"]
    )
    assert resumed.exit_code == 0, resumed.output[-3000:]
    last = _rows(run)[-1]
    assert last["round"] == 1 and last["status"] == "ok"
    assert last["clients_succeeded"] == 2 and last["clients_rejected"] == 1
    assert any("dtype float64" in why for why in last["rejected"].values())  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["quick", "--rounds", "0"], "num-server-rounds must be > 0"),
        (["no-such-scenario"], "no scenario 'no-such-scenario'"),
        (["quick", "--set", "strategy=fedsgd"], "strategy must be one of"),
        (["quick", "--set", "rounds=3"], "unknown config key"),
    ],
)
def test_bad_cli_input_is_named(args: list[str], expected: str) -> None:
    """Bad rounds, scenario, strategy or key: exit code 2 and a message naming it (no run starts)."""
    from typer.testing import CliRunner

    from fedge.simulations.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert expected in " ".join(result.output.split())


@pytest.fixture(autouse=True)
def _no_leftover_processes():  # type: ignore[no-untyped-def]
    """After each test, stop any process our runs started that is still alive (by pid)."""
    yield
    _kill_marked()
