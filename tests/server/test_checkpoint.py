"""Checkpoints round-trip exactly, and the newest complete one wins."""

from __future__ import annotations

import numpy as np
import pytest

from server.checkpoint import Checkpoint, latest_round, load_checkpoint, save_checkpoint
from strategies.base import GlobalState


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
