"""Reply validation and the flat run config, without transport."""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedge.server.aggregation import build_aggregator, validate_contribution
from fedge.server.config import RunConfig

SPEC = {"delta/w": (2, 3), "meta/weight": (1,), "meta/count": (1,)}


def _record(**changes: np.ndarray | None) -> ArrayRecord:
    arrays: dict[str, np.ndarray | None] = {
        "delta/w": np.zeros((2, 3), np.float32),
        "meta/weight": np.ones(1, np.float32),
        "meta/count": np.ones(1, np.float32),
    }
    arrays.update(changes)
    return ArrayRecord({k: Array(v) for k, v in arrays.items() if v is not None})


def test_a_valid_contribution_passes() -> None:
    assert validate_contribution(_record(), SPEC) is None


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"delta/w": None}, "missing \\['delta/w'\\]"),
        ({"delta/extra": np.zeros(1, np.float32)}, "unexpected \\['delta/extra'\\]"),
        ({"delta/w": np.zeros((2, 3), np.float64)}, "dtype float64"),
        ({"delta/w": np.zeros((3, 2), np.float32)}, "shape \\(3, 2\\)"),
        ({"delta/w": np.array([[0, np.nan, 0], [0, 0, 0]], np.float32)}, "NaN or Inf"),
        ({"meta/weight": np.array([np.inf], np.float32)}, "NaN or Inf"),
    ],
)
def test_malformed_contributions_are_named(
    changes: dict[str, np.ndarray | None], reason: str
) -> None:
    problem = validate_contribution(_record(**changes), SPEC)
    assert problem is not None
    assert re.search(reason, problem)


def test_no_record_at_all() -> None:
    assert "no 'contribution'" in (validate_contribution(None, SPEC) or "")


def test_run_config_coerces_validates_and_keeps_plugin_keys() -> None:
    cfg = RunConfig.from_mapping(
        {"num-server-rounds": "4", "client-eval": "false", "dp-noise": 1.1, "lora-r": 2}
    )
    assert cfg.num_server_rounds == 4 and cfg.client_eval is False and cfg.train.lora_r == 2
    assert cfg.client_config()["dp-noise"] == 1.1
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg
    with pytest.raises(ValueError, match="unknown config key"):
        RunConfig.from_mapping({"num-rounds": 3})
    with pytest.raises(ValueError, match="strategy must be one of"):
        RunConfig.from_mapping({"strategy": "fedsgd"})


def test_an_unknown_aggregator_path_is_explained() -> None:
    with pytest.raises(ValueError, match="neither a built-in name"):
        build_aggregator("secure", RunConfig())
    with pytest.raises(ValueError, match="cannot import"):
        build_aggregator("no_such_pkg.mod:make", RunConfig())
