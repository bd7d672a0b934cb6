"""Device shards: a population larger than the partitions draws contiguous slices of them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedge.data import FederatedCorpus
from fedge.data.shards import device_tokens
from fedge.errors import DataError


def _corpus(root: Path, sizes: list[int]) -> FederatedCorpus:
    """Partitions whose train tokens are 1000*p + position, so a slice names where it came from."""
    clients = []
    for p, n in enumerate(sizes):
        np.save(root / f"{p:04d}.train.npy", np.arange(n, dtype=np.int32) + 1000 * p)
        np.save(root / f"{p:04d}.heldout.npy", np.full(4, -p, dtype=np.int32))
        clients.append(
            {
                "client_id": f"pkg{p}",
                "documents": [],
                "labels": {},
                "train_tokens": n,
                "heldout_tokens": 4,
            }
        )
    (root / "clients.json").write_text(json.dumps({"spec": {}, "clients": clients}))
    return FederatedCorpus(root)


def test_a_population_within_the_partitions_gets_whole_partitions(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path, [10, 20, 30])
    got = device_tokens(corpus, 1, population=3, min_tokens=2)
    assert got.client_id == "pkg1" and list(got.train) == list(range(1000, 1020))


def test_devices_take_equal_contiguous_slices_in_partition_order(tmp_path: Path) -> None:
    """60 tokens over 6 devices: 10 each; partitions of 10/20/30 serve 1/2/3 devices."""
    corpus = _corpus(tmp_path, [10, 20, 30])
    slices = [device_tokens(corpus, d, population=6, min_tokens=2) for d in range(6)]
    assert [int(s.train[0]) for s in slices] == [0, 1000, 1010, 2000, 2010, 2020]
    assert all(len(s.train) == 10 for s in slices)
    assert [int(s.heldout[0]) for s in slices] == [0, -1, -1, -2, -2, -2]
    assert slices[2].client_id == "pkg1/device-2"


def test_a_slice_straddling_a_boundary_joins_two_partitions(tmp_path: Path) -> None:
    """4 devices: 15 tokens each; device 0 = all of partition 0 + the first 5 of partition 1."""
    corpus = _corpus(tmp_path, [10, 20, 30])
    got = device_tokens(corpus, 0, population=4, min_tokens=2)
    assert list(got.train) == [*range(10), *range(1000, 1005)]
    assert int(got.heldout[0]) == 0  # evaluates where its slice starts


def test_tiny_slices_widen_to_the_minimum_and_stay_inside_the_corpus(tmp_path: Path) -> None:
    """60 tokens over 60 devices with 17 needed: windows of 17; the last ones slide back to fit."""
    corpus = _corpus(tmp_path, [10, 20, 30])
    last = device_tokens(corpus, 59, population=60, min_tokens=17)
    assert len(last.train) == 17 and list(last.train) == list(range(2013, 2030))
    assert len(device_tokens(corpus, 5, population=60, min_tokens=17).train) == 17


def test_an_id_outside_the_population_is_named(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path, [10, 20, 30])
    with pytest.raises(DataError, match="partition-id 7 is outside the population of 6"):
        device_tokens(corpus, 7, population=6, min_tokens=2)


def test_the_pools_of_a_population_are_the_partitions_its_slices_start_in(tmp_path: Path) -> None:
    """Server-side participants: devices 0..5 of 6 start in partitions 0, 1, 1, 2, 2, 2."""
    from fedge.data.shards import device_pools

    corpus = _corpus(tmp_path, [10, 20, 30])
    assert device_pools(corpus, range(6)) == [0, 1, 2]
    assert device_pools(corpus, [1, 2, 5]) == [1, 2]
    assert device_pools(corpus, [0, 2]) == [0, 2]  # within the partitions: the partitions
