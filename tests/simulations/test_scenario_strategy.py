"""A scenario's ``[strategy.<name>]`` tables: each strategy's own keys, applied when it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from fedge.simulations.runner import SCENARIO_DIR, load_scenario


def test_each_strategy_trains_at_the_phones_scenarios_own_rate_and_the_cli_still_wins() -> None:
    """The phones scenario compares FedAvg and FedProx (AdamW) with SCAFFOLD (SGD): each run
    takes its strategy's ``lr`` from the file; a CLI override beats it. The old loader refused
    the table as unknown, and every strategy ran at the one ``[config]`` rate."""
    tables = tomllib.loads((SCENARIO_DIR / "phones.toml").read_text())["strategy"]
    for name in ("fedavg", "fedprox", "scaffold"):
        cfg = load_scenario("phones", {"strategy": name}).config
        assert cfg.strategy == name and cfg.train.lr == pytest.approx(tables[name]["lr"])
    assert tables["scaffold"]["lr"] != tables["fedavg"]["lr"]
    assert load_scenario("phones", {"strategy": "scaffold", "lr": 0.05}).config.train.lr == 0.05


def test_a_strategy_entry_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    """``strategy = ...`` at the top level (not ``[strategy.fedavg]``) names the form to use."""
    path = tmp_path / "bad.toml"
    path.write_text('[config]\nstrategy = "fedavg"\n\n[strategy]\nfedavg = 0.01\n')
    with pytest.raises(ValueError, match=r"\[strategy.fedavg\]"):
        load_scenario(str(path))
