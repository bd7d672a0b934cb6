"""BOS first wherever the tokenizer adds BOS: training windows, held-out windows, DP-SGD
records, agreement/serving prompts; nothing changes for a tokenizer without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedge.clients.privacy.dpsgd import token_records
from fedge.clients.trainer import random_windows
from fedge.edge.prompts import heldout_prompts
from fedge.lm.bos import bos_token_id, cut_windows, model_bos_token_id
from fedge.lm.evaluate import eval_windows
from fedge.models import load_tokenizer
from fedge.zoo import ZooPaths


@pytest.fixture(scope="module")
def bos_tokenizer_dir(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The micro zoo's tokenizer with ``add_bos_token: true`` (as Gemma 3's says)."""
    directory = tmp_path_factory.mktemp("bos-tokenizer")
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        if (micro_zoo.target_dir / name).is_file():
            shutil.copy(micro_zoo.target_dir / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer = load_tokenizer(micro_zoo.target_dir)
    bos = tokenizer.bos_token or tokenizer.eos_token
    config.update(add_bos_token=True, bos_token=bos)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


STREAM = np.arange(100, 1100, dtype=np.uint16)  # no BOS anywhere in the stream


def test_a_tokenizer_that_adds_bos_gives_its_id_and_the_micro_tokenizer_none(
    micro_zoo: ZooPaths, bos_tokenizer_dir: Path
) -> None:
    bos = model_bos_token_id(str(bos_tokenizer_dir))
    assert bos is not None and bos == bos_token_id(load_tokenizer(bos_tokenizer_dir))
    assert model_bos_token_id(str(micro_zoo.target_dir)) is None
    assert bos_token_id(load_tokenizer(micro_zoo.target_dir)) is None


def test_every_window_cutter_puts_bos_first(bos_tokenizer_dir: Path) -> None:
    """Before the fix windows started mid-stream (Gemma 3: perplexity 25.07 instead of 7.44)."""
    bos = model_bos_token_id(str(bos_tokenizer_dir))
    assert bos is not None
    train = random_windows(STREAM, 4, 16, np.random.default_rng(0), bos)
    held = list(eval_windows(STREAM, 16, 4, bos))
    records = token_records(STREAM, 16, bos)
    for rows in (train, *held, records):
        assert rows.shape[1] == 17
        assert (rows[:, 0] == bos).all() and (rows[:, 1:] != bos).all()
        assert (np.diff(rows[:, 1:].numpy(), axis=1) == 1).all()  # contiguous stream tokens
    # disjoint records stride by the 16 stream tokens each holds: none lost, none repeated
    assert records[:, 1:].reshape(-1).tolist() == STREAM[: len(records) * 16].tolist()
    prompts = heldout_prompts(load_tokenizer(bos_tokenizer_dir), 3, 8)
    assert all(p[0] == bos and len(p) == 9 for p in prompts)


def test_without_bos_the_windows_are_what_they_were(micro_zoo: ZooPaths) -> None:
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    train = random_windows(STREAM, 4, 16, rng_a, None)
    starts = rng_b.integers(0, len(STREAM) - 17, size=4)
    assert train.tolist() == [STREAM[s : s + 17].tolist() for s in starts]
    held = list(eval_windows(STREAM, 16, 3, None))
    assert held[0][0].tolist() == STREAM[:17].tolist()
    records = token_records(STREAM, 16)
    assert records.tolist() == STREAM[: len(STREAM) // 17 * 17].reshape(-1, 17).tolist()
    assert cut_windows(STREAM, [5], 16, None).tolist() == [STREAM[5:22].tolist()]
    prompts = heldout_prompts(load_tokenizer(micro_zoo.target_dir), 3, 8)
    assert all(len(p) == 8 for p in prompts)
