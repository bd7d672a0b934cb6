"""fedge.strategies.arrays.array_numpy reads a Flower Array exactly as Array.numpy() does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array

from fedge.strategies.arrays import array_numpy


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.zeros((0,), np.float32),
        np.array(3.0, dtype=np.float32),
        np.asfortranarray(np.arange(12.0).reshape(3, 4)),  # falls back to Array.numpy()
        np.arange(5, dtype=">i4"),
        torch.arange(6.0).reshape(2, 3),
    ],
)
def test_the_same_values_dtype_and_shape_in_a_fresh_writable_array(value: object) -> None:
    """Every layout Flower writes reads back equal to Array.numpy(), writable and not shared."""
    arr = Array(value)  # type: ignore[arg-type]
    got, want = array_numpy(arr), arr.numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    assert got.flags.writeable
    got[...] = 0  # a copy: the Array's bytes are unchanged
    assert np.array_equal(arr.numpy(), want)
