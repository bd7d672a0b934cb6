"""A resume under churn is exact: N, the participants and the device clock survive a crash.

One SCAFFOLD federation on the in-process engine (micro zoo): five devices, four online; after
round 1 device 3 leaves for good. Run uninterrupted, and crashed in round 2 then resumed on a
fresh grid where device 3 is still gone: the rounds after the crash must match.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.server.app import OutcomeBox, make_server_app
from fedge.server.config import RunConfig
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.simulations.runner import client_roots
from tests.simulations.federations import CONFIG, client_app


class Crash(RuntimeError):
    """The ServerApp process dies (raised from the row callback, before the checkpoint)."""


class UnsizedGrid(InProcessGrid):
    """An engine that does not know its population (like Flower's Ray engine): N is learnt."""

    @property
    def population_size(self) -> int:
        return 0


def _run(root: Path, online: list[int], crash_at: int = -1, resume: bool = False) -> OutcomeBox:
    """Run (or resume) the federation in ``root``; device 3 leaves after round 1."""
    from fedge.lm import holder

    grid = UnsizedGrid(client_app(), DeviceTable(5, online=np.array(online)), root / "state")
    cfg = RunConfig.from_mapping(
        {**CONFIG, "run-dir": str(root / "run"), "client-state-dir": str(root / "cs")}
    )

    def on_row(row: Mapping[str, Any]) -> None:
        if row["round"] == 1:
            grid.disconnect([3])
        if row["round"] == crash_at:
            raise Crash(f"killed in round {crash_at}")

    box = OutcomeBox()
    holder.configure_threads(0)
    with client_roots(cfg):  # the test runs every node: their roots hold its paths
        run_inprocess(make_server_app(cfg, resume=resume, on_row=on_row, box=box), grid)
    return box


def _rows(root: Path) -> dict[int, dict[str, Any]]:
    from fedge.server.rundir import MetricsLog

    return {int(r["round"]): r for r in MetricsLog(root / "run").rows()}


def test_a_resume_after_churn_continues_with_the_same_n_and_participants(
    micro_zoo,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """The crash hits round 2 before its checkpoint; the resume replays rounds 2 and 3 with
    device 3 gone. It must score the same participants (all four first seen) and divide
    SCAFFOLD's control-variate update by the same N = 4. On main the resumed roster knew
    only the three connected partitions: N = 3 and three participants, so the participants'
    loss and the final adapter differed from the uninterrupted run."""
    whole = _run(tmp_path / "whole", [1, 1, 1, 1, 0])
    with pytest.raises(Crash):
        _run(tmp_path / "crashed", [1, 1, 1, 1, 0], crash_at=2)
    resumed = _run(tmp_path / "crashed", [1, 1, 1, 0, 0], resume=True)
    assert whole.outcome is not None and resumed.outcome is not None
    assert resumed.outcome.status == "completed"
    a, b = _rows(tmp_path / "whole"), _rows(tmp_path / "crashed")
    for r in (2, 3):
        assert b[r]["partitions_trained"] == a[r]["partitions_trained"] == [0, 1, 2]
        assert b[r]["participants_eval_loss"] == pytest.approx(a[r]["participants_eval_loss"])
    from fedge.server.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tmp_path / "crashed" / "run")
    assert (ckpt.seen, ckpt.participants) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert whole.outcome.state is not None and resumed.outcome.state is not None
    for name, value in whole.outcome.state.extras.items():
        np.testing.assert_allclose(resumed.outcome.state.extras[name], value, rtol=1e-6)


def test_a_crash_while_saving_the_device_clock_leaves_a_resumable_run(
    micro_zoo,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device clock of round 2 fails to save (a full disk: a fault mocked because it cannot
    be caused here). The clock is saved before the round's checkpoint, so the newest checkpoint
    is round 1, whose clock is on disk: the resume replays round 2 and completes. On main the
    checkpoint of round 2 was written first and the resume refused: "the device clock of
    round 2 cannot be restored; start a fresh run"."""
    from fedge.simulations.devicesim.grid import DeviceSim
    from fedge.simulations.runner import _scenario_from_tables, run_simulation

    scenario = _scenario_from_tables(
        "clock",
        {"num-supernodes": 3, "engine": "inprocess"},
        {**CONFIG, "strategy": "fedavg", "num-server-rounds": 2},
        None,
        None,
        {"tiers": "workstation:1", "deadline-s": 600},
    )
    save = DeviceSim.save

    def failing_save(self: DeviceSim, path: Path) -> None:
        if path.name == "round_0002.npz":
            raise OSError(28, "No space left on device")
        save(self, path)

    monkeypatch.setattr(DeviceSim, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        run_simulation(scenario, tmp_path / "run", client_app=client_app())
    monkeypatch.setattr(DeviceSim, "save", save)
    outcome = run_simulation(scenario, tmp_path / "run", resume=True, client_app=client_app())
    assert outcome is not None and outcome.status == "completed"
    rounds = [json.loads(line) for line in (tmp_path / "run" / "devices" / "rounds.jsonl").open()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[1]["start_s"] == pytest.approx(rounds[0]["end_s"])
