"""One source of defaults: pyproject's [tool.flwr.app.config] and RunConfig agree on every key."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from fedge.server.config import RunConfig
from fedge.server.loop import resolve_partition_count

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_app_config_equals_the_run_config_defaults() -> None:
    """Every key is in the table (so `flwr run --run-config` can set it) with RunConfig's default."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    parsed = RunConfig.from_mapping(table)
    defaults = RunConfig().to_mapping()
    plugin_keys = {k for k in table if k not in defaults}
    assert plugin_keys <= set(parsed.extra), plugin_keys
    assert {k: v for k, v in table.items() if k in defaults} == defaults


def test_num_partitions_zero_means_one_per_connected_node_for_iid() -> None:
    """iid/dirichlet with num-partitions=0 split the corpus into as many parts as nodes."""
    iid = RunConfig.from_mapping({"partition-scheme": "iid"})
    assert resolve_partition_count(iid, 7).num_partitions == 7
    fixed = RunConfig.from_mapping({"partition-scheme": "iid", "num-partitions": 3})
    assert resolve_partition_count(fixed, 7).num_partitions == 3
    natural = RunConfig()
    assert resolve_partition_count(natural, 7).num_partitions == 0


def test_num_partitions_is_refused_for_natural_partitioning() -> None:
    """natural means one client per package: a count there is a mistake, named in the error."""
    with pytest.raises(
        ValueError, match="num-partitions=5 does not apply to partition-scheme=natural"
    ):
        RunConfig.from_mapping({"num-partitions": 5})
