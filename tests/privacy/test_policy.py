"""The client's privacy policy: loading it, and which requests it refuses (no Flower run)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fedge.clients.privacy.policy import PrivacyPolicy, dpsgd_budget, node_policy, requested_dp
from fedge.clients.secagg.mod import node_rules


def test_a_policy_file_is_read_and_a_bad_one_is_never_an_empty_policy(tmp_path: Path) -> None:
    # Prepare
    good = tmp_path / "policy.toml"
    good.write_text("require-secagg = true\nmin-noise = 1.5\nmax-epsilon = 4.0\n")
    typo = tmp_path / "typo.toml"
    typo.write_text("require-secag = true\n")
    # Execute / Assert
    policy = node_policy({"privacy-policy": str(good)})
    assert policy == PrivacyPolicy(require_secagg=True, min_noise=1.5, max_epsilon=4.0)
    with pytest.raises(ValueError, match=r"unknown privacy policy key\(s\) \['require-secag'\]"):
        node_policy({"privacy-policy": str(typo)})
    with pytest.raises(ValueError, match="cannot read it"):
        node_policy({"privacy-policy": str(tmp_path / "missing.toml")})


def test_an_edited_policy_or_trust_list_applies_at_the_next_message(tmp_path: Path) -> None:
    """Both files are parsed once per content, not once per message: an operator who
    tightens either sees it at the very next message. Each rewrite keeps the file's inode
    and size within one mtime tick, so a cache keyed on the path or on the file's stat
    would serve the old, weaker rules here (seen with a path-keyed cache)."""
    # Prepare
    policy, trust = tmp_path / "policy.toml", tmp_path / "trust.txt"
    key_a, key_b = bytes(range(32)), bytes(range(1, 33))
    policy.write_text('secagg-min-neighbours = 2\ntrusted-keys = "trust.txt"\n')
    trust.write_text(key_a.hex() + "\n")
    context = Context(0, 1, {"privacy-policy": str(policy)}, RecordDict(), {})
    before = node_rules(context)
    # Execute: tighten both, in place
    policy.write_text('secagg-min-neighbours = 7\ntrusted-keys = "trust.txt"\n')
    trust.write_text(key_b.hex() + "\n")
    after = node_rules(context)
    # Assert
    assert (before.min_neighbours, before.trusted) == (2, frozenset({key_a}))
    assert (after.min_neighbours, after.trusted) == (7, frozenset({key_b}))
    assert node_policy(context.node_config).secagg_min_neighbours == 7


def test_requested_dp_reads_the_released_sums_multiplier() -> None:
    # distributed DP: std 0.05 per client, clip 0.1; the server's m = 4 is not trusted
    config = {"dp-clip-norm": 0.1, "dp-noise-std": 0.05, "dp-min-clients": 4}
    alone = requested_dp(config)
    assert alone is not None and alone.mechanism == "distributed DP"
    assert alone.noise_multiplier == pytest.approx(0.5) and alone.clip == 0.1
    # in a SecAgg+ collect with 4 neighbours and threshold 4, 2t - n = 4 neighbours share
    # every sum that holds this input: m = 5 -> z = 0.05 * sqrt(5) / 0.1
    secagg = {
        "stage": "collect-masked-input",
        "neighbours": np.arange(1, 5, dtype="<u8").tobytes(),
        "threshold": 4,
    }
    ddp = requested_dp(config, secagg)
    assert ddp is not None and ddp.noise_multiplier == pytest.approx(0.5 * math.sqrt(5))
    sgd = requested_dp({"dp-sgd-noise-multiplier": 1.2, "dp-sgd-max-grad-norm": 0.5})
    assert sgd is not None and (sgd.mechanism, sgd.noise_multiplier, sgd.clip) == (
        "DP-SGD",
        1.2,
        0.5,
    )
    assert requested_dp({"dp-active": True}) is None  # central DP: nothing applied on the node


def test_the_tighter_of_the_clients_and_the_runs_budget_applies() -> None:
    assert dpsgd_budget(PrivacyPolicy(max_epsilon=3.0), {"max-epsilon": 8.0}) == 3.0
    assert dpsgd_budget(PrivacyPolicy(), {"max-epsilon": 8.0}) == 8.0
    assert dpsgd_budget(PrivacyPolicy(), {}) == 0.0
