"""Robust aggregation and per-client bounds against poisoned clients (plain mode).

The federation is :mod:`fedge.simulations.synthetic`'s least-squares problem (10 clients, every
client in every round, 5 local SGD steps, 20 rounds; the real strategy, trainer and
contribution code). Two of the ten clients are malicious. The score is the fraction of
the clean FedAvg run's loss reduction a run keeps: (L0 - L) / (L0 - L_clean), 1.0 = as
good as the clean run, negative = worse than not training at all (deterministic; L0 = 3.140,
L_clean = 0.0618):

    attack            mean        median  trimmed-mean  krum (f=2)  weight cap 40
    none              1.000       0.993   0.996         0.986       1.000
    scaled x50        -5.6e36     0.995   0.996         0.989       -5.6e36
    sign-flip x-10    -2.6e14     0.988   0.992         0.989       -2.6e14
    weight 1e9        -2.2e10     0.987   0.992         0.989       0.985

The plain mean is ruined by each attack (it diverges); the robust rules keep >= 98%; the
weight cap alone answers only the weight attack; main had only the mean column.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedge import keys
from fedge.server.aggregation import PlainAggregator, build_aggregator
from fedge.server.config import RunConfig
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from fedge.simulations.synthetic import global_loss, make_clients, run_federation
from fedge.strategies.base import Arrays
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.registry import robust_config
from fedge.strategies.robust import (
    RobustConfig,
    RuleTooSmall,
    adaptive_bounds,
    apply_bounds,
    robust_sum,
    sizing_problem,
    update_norm,
)

CLIENTS = make_clients(10, 8, heterogeneity=0.1, seed=0)
ATTACKERS = {0, 1}
Tamper = Callable[[int, Arrays], Arrays]


def _scale_delta(factor: float) -> Tamper:
    """Attackers send factor x their honest delta (x50: scaled; x-10: sign-flipped and boosted)."""

    def tamper(i: int, c: Arrays) -> Arrays:
        if i not in ATTACKERS:
            return c
        return {
            k: v * np.float32(factor) if k.startswith(keys.PREFIX_DELTA) else v
            for k, v in c.items()
        }

    return tamper


def _huge_weight(i: int, c: Arrays) -> Arrays:
    """Attackers claim weight 1e9 and send their update sign-flipped at that weight."""
    if i not in ATTACKERS:
        return c
    w = float(c[keys.KEY_WEIGHT][0])
    out = {
        k: (-v / w * 1e9).astype(np.float32) if k.startswith(keys.PREFIX_DELTA) else v
        for k, v in c.items()
    }
    out[keys.KEY_WEIGHT] = np.array([1e9], np.float32)
    return out


def _combine(cfg: RobustConfig) -> Callable[[list[Arrays]], Arrays]:
    """What PlainAggregator does with the valid replies: bounds per client, then the rule."""

    def combine(contributions: list[Arrays]) -> Arrays:
        kept = []
        for c in contributions:
            bounded, why = apply_bounds(c, cfg)
            if why is None:
                kept.append(bounded)
        return robust_sum(kept, cfg)

    return combine


def _final_loss(cfg: RobustConfig, tamper: Tamper | None) -> float:
    history = run_federation(
        FedAvg(),
        CLIENTS,
        rounds=20,
        local_steps=5,
        lr=0.1,
        per_round=10,
        seed=1,
        combine=_combine(cfg),
        tamper=tamper,
    )
    return history[-1]


@pytest.fixture(scope="module")
def clean() -> tuple[float, float]:
    """(loss before training, the clean FedAvg run's final loss)."""
    return global_loss(CLIENTS, np.zeros(8)), _final_loss(RobustConfig(), None)


RULES = {
    "median": RobustConfig(rule="median"),
    "trimmed-mean": RobustConfig(rule="trimmed-mean"),
    "krum": RobustConfig(rule="krum", krum_malicious=2),
}


@pytest.mark.parametrize(
    "tamper",
    [_scale_delta(50.0), _scale_delta(-10.0), _huge_weight],
    ids=["scaled-x50", "sign-flip-x-10", "weight-1e9"],
)
def test_poisoned_clients_ruin_the_mean_and_not_the_robust_rules(
    clean: tuple[float, float], tamper: Tamper
) -> None:
    """Two of ten clients attack: the mean ends worse than no training; each robust rule keeps
    at least 98% of the clean run's loss reduction."""
    start, clean_loss = clean
    kept = lambda loss: (start - loss) / (start - clean_loss)  # noqa: E731
    assert kept(_final_loss(RobustConfig(), tamper)) < 0
    for name, cfg in RULES.items():
        assert kept(_final_loss(cfg, tamper)) >= 0.98, name


def test_weight_cap_alone_stops_the_huge_weight_attack(clean: tuple[float, float]) -> None:
    """Capping meta/weight at the largest honest count (40) turns 1e9 into one client's say."""
    start, clean_loss = clean
    capped = _final_loss(RobustConfig(max_weight=40), _huge_weight)
    assert (start - capped) / (start - clean_loss) >= 0.95


def test_bounds_cap_the_weight_and_refuse_a_large_update() -> None:
    """By hand: weight 100 capped to 10 rescales the delta by 0.1 (same update, less say);
    an update of norm 5 is refused at max-update-norm 4 with the reason."""
    c = {
        "delta/w": np.array([300.0, 400.0], np.float32),
        keys.KEY_WEIGHT: np.array([100.0], np.float32),
        keys.KEY_COUNT: np.array([1.0], np.float32),
    }
    assert update_norm(c) == pytest.approx(5.0)
    capped, why = apply_bounds(c, RobustConfig(max_weight=10))
    assert why is None
    np.testing.assert_allclose(capped["delta/w"], [30.0, 40.0])
    np.testing.assert_allclose(capped[keys.KEY_WEIGHT], [10.0])
    _, why = apply_bounds(c, RobustConfig(max_update_norm=4))
    assert why is not None and "max-update-norm" in why
    negative = {**c, keys.KEY_WEIGHT: np.array([-100.0], np.float32)}
    assert "impossible" in (apply_bounds(negative, RobustConfig())[1] or "")


def test_robust_sum_has_the_shape_of_a_sum() -> None:
    """Median of unscaled updates [1], [2], [100] (weights 1, 2, 4) is 2; written as a sum of
    three clients: delta 6, weight 3, count 3, so finalize's delta/weight gives 2."""
    cs = [
        {
            "delta/w": np.array([d * w], np.float32),
            keys.KEY_WEIGHT: np.array([w], np.float32),
            keys.KEY_COUNT: np.array([1.0], np.float32),
        }
        for d, w in ((1.0, 1.0), (2.0, 2.0), (100.0, 4.0))
    ]
    out = robust_sum(cs, RobustConfig(rule="median"))
    np.testing.assert_allclose(out["delta/w"], [6.0])
    np.testing.assert_allclose(out[keys.KEY_WEIGHT], [3.0])
    np.testing.assert_allclose(out[keys.KEY_COUNT], [3.0])


def test_plain_aggregator_applies_bounds_and_rule_over_a_real_grid(tmp_path: Path) -> None:
    """fedge's PlainAggregator, built from the run config, on 4 in-process nodes: the node
    with a huge update is rejected naming max-update-norm, the median of the rest is used."""
    updates = {0: 1.0, 1: 2.0, 2: 3.0, 3: 1000.0}
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        contribution = {
            "delta/w": Array(np.array([updates[pid] * 5.0], np.float32)),
            keys.KEY_WEIGHT: Array(np.array([5.0], np.float32)),
            keys.KEY_COUNT: Array(np.array([1.0], np.float32)),
        }
        metrics = MetricRecord({keys.MET_PARTITION: pid})
        return Message(
            RecordDict({keys.REC_CONTRIB: ArrayRecord(contribution), keys.REC_METRICS: metrics}),
            reply_to=msg,
        )

    cfg = RunConfig.from_mapping({"aggregator": "median", "max-update-norm": 100.0})
    aggregator = build_aggregator(cfg.aggregator, cfg)
    assert isinstance(aggregator, PlainAggregator)
    results = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        spec = {"delta/w": (1,), keys.KEY_WEIGHT: (1,), keys.KEY_COUNT: (1,)}
        results.append(
            aggregator.aggregate(grid, 1, list(grid.get_node_ids()), RecordDict(), spec, 60)
        )

    grid = InProcessGrid(app, DeviceTable(4), tmp_path / "state")
    run_inprocess(server, grid)
    result = results[0]
    assert len(result.accepted) == 3
    assert ["max-update-norm" in why for why in result.rejected.values()] == [True]
    assert result.summed is not None
    np.testing.assert_allclose(result.summed["delta/w"] / result.summed[keys.KEY_WEIGHT], [2.0])


# ---------------------------------------------------------------- the default defence
def _client(update: np.ndarray, weight: float) -> Arrays:
    return {
        "delta/w": (update * weight).astype(np.float32),
        keys.KEY_WEIGHT: np.array([weight], np.float32),
        keys.KEY_COUNT: np.array([1.0], np.float32),
    }


def _honest(n: int, seed: int = 0) -> tuple[list[np.ndarray], list[float]]:
    """n honest clients: updates around one direction (norms within ~1.5x), weights 30-50."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=16)
    updates = [base + 0.3 * rng.normal(size=16) for _ in range(n)]
    return updates, [float(w) for w in rng.integers(30, 50, size=n)]


def _mean_update(contributions: list[Arrays]) -> np.ndarray:
    summed = robust_sum(contributions, RobustConfig())
    return np.asarray(summed["delta/w"] / summed[keys.KEY_WEIGHT])


@pytest.mark.parametrize(("n", "attackers"), [(3, 1), (5, 1), (7, 2)])
def test_the_default_defence_removes_a_scaled_update_with_a_huge_weight(
    n: int, attackers: int
) -> None:
    """The issue's attack with no option set: attackers send their update x(-50) at weight
    x1e6. Before the default defence the plain mean was the attackers' update (cosine with the
    honest mean below -0.9; perplexity 214 -> 18,658 at 5 clients); now they are refused, naming
    the bound, and the mean is the honest clients' mean exactly."""
    updates, weights = _honest(n)
    clean = [_client(u, w) for u, w in zip(updates, weights, strict=True)]
    poisoned = [
        _client(-50 * u, w * 1e6) if i < attackers else c
        for i, (u, w, c) in enumerate(zip(updates, weights, clean, strict=True))
    ]
    plain = RobustConfig(norm_multiple=0, weight_multiple=0)
    undefended = _mean_update(adaptive_bounds(poisoned, plain)[0])
    honest_mean = _mean_update(clean[attackers:])
    cosine = (
        float(undefended @ honest_mean) / np.linalg.norm(undefended) / np.linalg.norm(honest_mean)
    )
    assert cosine < -0.9  # the attack's effect before: the mean points the other way
    kept, refused = adaptive_bounds(poisoned, RobustConfig())
    assert sorted(refused) == list(range(attackers))
    assert all("norm-bound-multiple" in why for why in refused.values())
    np.testing.assert_allclose(_mean_update(kept), honest_mean, rtol=1e-5)


def test_the_default_defence_leaves_a_clean_round_exact_and_caps_a_weight_alone() -> None:
    """A clean round: nothing refused, nothing capped, the sum is the plain sum bit for bit.
    A client that claims weight x1e6 with an honest update is capped at 3x the median weight
    (its update kept: only its say shrinks)."""
    updates, weights = _honest(5, seed=3)
    clean = [_client(u, w) for u, w in zip(updates, weights, strict=True)]
    kept, refused = adaptive_bounds(clean, RobustConfig())
    assert refused == {}
    for a, b in zip(kept, clean, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    heavy = [_client(updates[0], weights[0] * 1e6), *clean[1:]]
    kept, refused = adaptive_bounds(heavy, RobustConfig())
    assert refused == {}
    median = float(np.median([c[keys.KEY_WEIGHT][0] for c in heavy]))
    assert float(kept[0][keys.KEY_WEIGHT][0]) == pytest.approx(3 * median)
    np.testing.assert_allclose(update_norm(kept[0]), update_norm(heavy[0]), rtol=1e-5)


def test_the_default_defence_needs_three_clients_and_can_be_switched_off() -> None:
    """Two clients: a median of two is their mean, so the attacker's own norm would set the
    bound; the round is left as it is (the docs say so). Multiples 0 switch it off."""
    updates, weights = _honest(3)
    two = [_client(-50 * updates[0], weights[0]), _client(updates[1], weights[1])]
    assert adaptive_bounds(two, RobustConfig())[1] == {}
    three = [*two, _client(updates[2], weights[2])]
    assert list(adaptive_bounds(three, RobustConfig())[1]) == [0]
    assert adaptive_bounds(three, RobustConfig(norm_multiple=0, weight_multiple=0))[1] == {}
    with pytest.raises(ValueError, match="norm-bound-multiple"):
        RobustConfig(norm_multiple=0.5)


def test_a_run_config_with_no_option_set_defends_and_its_keys_reach_the_rule() -> None:
    """RunConfig defaults (the pyproject table) turn the defence on; the keys switch it off."""
    on = robust_config(RunConfig().to_mapping())
    assert (on.norm_multiple, on.weight_multiple, on.strict) == (3.0, 3.0, False)
    off = robust_config(
        RunConfig.from_mapping(
            {"norm-bound-multiple": 0.0, "weight-cap-multiple": 0.0, "robust-strict": True}
        ).to_mapping()
    )
    assert (off.norm_multiple, off.weight_multiple, off.strict) == (0.0, 0.0, True)


def test_undersized_robust_rules_warn_and_strict_mode_refuses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trimmed mean's default beta 0.2 at 3 clients trims nothing (0.2 x 3 < 1: before, it
    returned the plain mean silently, perplexity 3,773 with one attacker of 3); Krum with f=1
    over 4 clients (n <= 2f + 2) could select the attacker. Each is a warning naming the fix,
    and RuleTooSmall under robust-strict; big enough rounds say nothing."""
    updates, weights = _honest(7)
    cs = [_client(u, w) for u, w in zip(updates, weights, strict=True)]
    with caplog.at_level("WARNING", logger="fedge.strategies.robust"):
        robust_sum(cs[:3], RobustConfig(rule="trimmed-mean"))
        robust_sum(cs[:4], RobustConfig(rule="krum", krum_malicious=1))
    assert any("cuts nothing" in r.message for r in caplog.records)
    assert any("more than 2f + 2 = 4" in r.message for r in caplog.records)
    with pytest.raises(RuleTooSmall, match="trimmed-mean-beta"):
        robust_sum(cs[:3], RobustConfig(rule="trimmed-mean", strict=True))
    with pytest.raises(RuleTooSmall, match="krum"):
        robust_sum(cs[:4], RobustConfig(rule="krum", krum_malicious=1, strict=True))
    assert sizing_problem("trimmed-mean", 5, RobustConfig()) is None
    assert sizing_problem("krum", 5, RobustConfig(krum_malicious=1)) is None


def test_plain_aggregator_refuses_the_poisoned_node_by_default_over_a_real_grid(
    tmp_path: Path,
) -> None:
    """No option set, 5 in-process nodes, node 4 sends its update x(-50) at weight x1e6: it is
    rejected (its reason names norm-bound-multiple), not accepted, and the sum is the other
    four's mean (before: the sum's mean update was -49.9, the attacker's)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        update, weight = (1.0 + 0.1 * pid, 10.0) if pid < 4 else (-50.0, 1e7)
        contribution = {
            "delta/w": Array(np.array([update * weight], np.float32)),
            keys.KEY_WEIGHT: Array(np.array([weight], np.float32)),
            keys.KEY_COUNT: Array(np.array([1.0], np.float32)),
        }
        metrics = MetricRecord({keys.MET_PARTITION: pid})
        return Message(
            RecordDict({keys.REC_CONTRIB: ArrayRecord(contribution), keys.REC_METRICS: metrics}),
            reply_to=msg,
        )

    cfg = RunConfig()
    aggregator = build_aggregator(cfg.aggregator, cfg)
    results = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        spec = {"delta/w": (1,), keys.KEY_WEIGHT: (1,), keys.KEY_COUNT: (1,)}
        results.append(
            aggregator.aggregate(grid, 1, list(grid.get_node_ids()), RecordDict(), spec, 60)
        )

    grid = InProcessGrid(app, DeviceTable(5), tmp_path / "state")
    run_inprocess(server, grid)
    result = results[0]
    assert len(result.accepted) == 4 and len(result.rejected) == 1
    (why,) = result.rejected.values()
    assert "norm-bound-multiple" in why
    assert set(result.metrics) == set(result.accepted)
    assert result.summed is not None
    np.testing.assert_allclose(result.summed["delta/w"] / result.summed[keys.KEY_WEIGHT], [1.15])


@pytest.mark.parametrize(
    ("optimizer", "lr"),
    [("none", 1.0), ("fedavgm", 1.0), ("fedadam", 0.1), ("fedyogi", 0.01), ("fedadagrad", 0.1)],
)
def test_server_lr_zero_is_the_optimizers_own_default(optimizer: str, lr: float) -> None:
    """server-lr defaults to 0, which means the optimizer's own (Flower's) step: FedAdam 0.1,
    not the 1.0 every optimizer got before; an explicit value still wins."""
    from fedge.strategies.registry import build_strategy

    mapping = RunConfig.from_mapping({"server-optimizer": optimizer}).to_mapping()
    assert mapping["server-lr"] == 0.0
    assert build_strategy(mapping).server_lr == lr
    assert build_strategy({**mapping, "server-lr": 0.5}).server_lr == 0.5
    from fedge.strategies.server_opt import ServerOptConfig

    assert FedAvg(server_optimizer=ServerOptConfig(optimizer)).server_lr == lr  # a Flower app


def test_central_dp_keeps_its_inner_sum_exact() -> None:
    """Central DP's sensitivity is the clip C: a refusal relative to the round's median norm
    would make one client's presence depend on the others' data (the sum could move by more
    than C), so its inner PlainAggregator runs with the default defence off."""
    from fedge.server.privacy.factories import central_dp

    cfg = RunConfig.from_mapping({"weighting": "uniform"})
    inner = central_dp(cfg).inner
    assert isinstance(inner, PlainAggregator)
    assert (inner.robust.norm_multiple, inner.robust.weight_multiple) == (0.0, 0.0)
    assert isinstance(build_aggregator("plain", cfg), PlainAggregator)
    assert build_aggregator("plain", cfg).robust.norm_multiple == 3.0  # type: ignore[attr-defined]
