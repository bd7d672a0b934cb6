"""Checkpoints round-trip exactly, and the newest complete one wins."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.server.checkpoint import Checkpoint, latest_round, load_checkpoint, save_checkpoint
from fedge.strategies.base import GlobalState

ADAPTER = {"a.lora_A": np.zeros((2, 4), np.float32)}


def test_checkpoint_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    rng.random(5)
    state = GlobalState(
        {"a.lora_A": rng.normal(size=(2, 4)).astype(np.float32)},
        {"ctrl/a.lora_A": np.ones((2, 4), np.float32)},
        2,
    )
    save_checkpoint(tmp_path, Checkpoint(GlobalState(state.adapter, {}, 1), {}, {}, "fedavg"))
    save_checkpoint(
        tmp_path, Checkpoint(state, dict(rng.bit_generator.state), {"eps": 0.5}, "scaffold")
    )
    (tmp_path / "checkpoints" / ".tmp_round_0003").mkdir()  # a half-written checkpoint is ignored
    assert latest_round(tmp_path) == 2
    loaded = load_checkpoint(tmp_path)
    np.testing.assert_array_equal(loaded.state.adapter["a.lora_A"], state.adapter["a.lora_A"])
    np.testing.assert_array_equal(loaded.state.extras["ctrl/a.lora_A"], 1.0)
    restored = np.random.default_rng(0)
    restored.bit_generator.state = loaded.rng_state
    assert restored.random() == rng.random()
    assert loaded.budget_state == {"eps": 0.5} and loaded.strategy == "scaffold"


def test_resume_without_checkpoint_says_what_to_do(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError, match="start a new run"):
        load_checkpoint(tmp_path)


def test_committed_rounds_and_config_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The run id, the config and each partition's committed round come back as saved."""
    state = GlobalState({"a": np.zeros(2, np.float32)}, {}, 4)
    save_checkpoint(
        tmp_path, Checkpoint(state, {}, {}, "scaffold", "abc", {"seed": 1}, {3: 4, 11: 2})
    )
    loaded = load_checkpoint(tmp_path)
    assert (loaded.run_id, loaded.config, loaded.committed) == ("abc", {"seed": 1}, {3: 4, 11: 2})


def test_resume_refuses_a_changed_config_and_names_the_difference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint made by FedAvg is not resumed as SCAFFOLD; the message names both values."""
    from fedge.server.checkpoint import check_resumable
    from fedge.server.config import RunConfig
    from fedge.strategies.registry import build_strategy

    saved = RunConfig.from_mapping({"strategy": "fedavg", "num-server-rounds": 2})
    ckpt = Checkpoint(GlobalState(ADAPTER, {}, 2), {}, {}, "fedavg", "abc", saved.to_mapping())
    changed = saved.with_overrides({"strategy": "scaffold", "num-server-rounds": 5})
    with pytest.raises(
        ValueError, match="strategy: checkpoint has 'fedavg', this run has 'scaffold'"
    ):
        check_resumable(ckpt, changed, build_strategy(changed.to_mapping()), tmp_path)
    more_rounds = saved.with_overrides({"num-server-rounds": 5})  # steering keys may change
    check_resumable(ckpt, more_rounds, build_strategy(more_rounds.to_mapping()), tmp_path)


def test_a_fresh_run_archives_an_earlier_run_instead_of_mixing_with_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Checkpoints and metrics of the earlier run move under previous/; nothing is deleted."""
    from fedge.server.checkpoint import archive_previous_run

    save_checkpoint(tmp_path, Checkpoint(GlobalState(ADAPTER, {}, 3), {}, {}, "fedavg"))
    (tmp_path / "metrics.jsonl").write_text('{"round": 3}\n')
    archived = archive_previous_run(tmp_path)
    assert archived is not None and latest_round(tmp_path) is None
    assert latest_round(archived) == 3 and (archived / "metrics.jsonl").is_file()
    assert archive_previous_run(tmp_path) is None  # nothing left to move


def test_the_roster_round_trips_and_an_older_checkpoint_still_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Partitions seen and participants come back as saved (a resume under churn keeps N and
    the participants); a checkpoint written before they existed loads with both empty."""
    import json

    state = GlobalState(ADAPTER, {}, 2)
    save_checkpoint(
        tmp_path, Checkpoint(state, {}, {}, "fedavg", seen=[0, 4, 9], participants=[0, 4])
    )
    loaded = load_checkpoint(tmp_path)
    assert (loaded.seen, loaded.participants) == ([0, 4, 9], [0, 4])
    meta = tmp_path / "checkpoints" / "round_0002" / "meta.json"
    old = {
        k: v for k, v in json.loads(meta.read_text()).items() if k not in ("seen", "participants")
    }
    meta.write_text(json.dumps(old))
    assert (load_checkpoint(tmp_path).seen, load_checkpoint(tmp_path).participants) == ([], [])
