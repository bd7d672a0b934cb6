"""Malicious clients against the SecAgg+ server: a bad seed share is attributed to whoever made it.

On main a share that did not combine aborted the round naming no one ("shares of the
self-mask seed of node v do not combine", read from main's code): one malicious client
could stop every round anonymously. Shares are now signed by their owner inside the
sealed box, and the server checks signatures when a combine fails: an altered share
blames its holder (and is dropped, the spare share completes the round); validly signed
shares that do not combine blame their owner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pytest
from flwr.app import RecordDict

import fedge.clients.secagg.engine as client_engine
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.server.secagg.engine import SecAggRoundFailed, SecAggServerEngine
from fedge.server.secagg.protocol import run_secagg
from fedge.strategies.robust import RobustConfig, clip_contribution, update_norm
from tests.secagg.conftest import Federation, random_contributions

MASKED = "masked"


def alter_shares(fed: Federation, holder: int) -> Callable[..., dict[int, RecordDict]]:
    """An exchange where ``holder`` alters every share it reveals at unmask."""

    def exchange(stage: str, requests: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
        out = fed.exchange(stage, requests)
        if stage == wire.STAGE_UNMASK and holder in out:
            rec = out[holder][wire.SECAGG_RECORD]
            # drop the share's last byte (its signature stays): it no longer parses, nor verifies
            rec[wire.KEY_SHARES] = [s[:67] + s[68:] for s in rec[wire.KEY_SHARES]]
        return out

    return exchange


def test_a_holder_that_alters_shares_is_blamed_and_the_round_completes() -> None:
    # Prepare: 5 clients, 4 neighbours each, threshold 3 (+1 spare share per node)
    fed = Federation(random_contributions(5, 21, 200))
    nodes = sorted(fed.contributions)
    engine = SecAggServerEngine(
        SecAggConfig(num_shares=1.0, reconstruction_threshold=3), nodes, MASKED
    )
    # Execute: the first holder's shares come first for every owner
    got = run_secagg(engine, alter_shares(fed, nodes[0]))
    # Assert
    assert engine.blamed == {nodes[0]}
    want = sum(fed.contributions[u]["delta/layer.lora_B"].astype(np.float64) for u in nodes)
    assert np.max(np.abs(got["delta/layer.lora_B"] - want)) < 1e-4


def test_a_dealer_of_bad_shares_is_blamed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: one client deals shares that cannot combine (all at one index), signed by it
    fed = Federation(random_contributions(5, 22, 200))
    nodes = sorted(fed.contributions)
    dealer = nodes[2]
    honest_split = client_engine.split_secret

    def exchange(stage: str, requests: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
        if stage != wire.STAGE_COLLECT:
            return fed.exchange(stage, requests)
        out = fed.exchange(stage, {u: r for u, r in requests.items() if u != dealer})
        with monkeypatch.context() as mp:
            mp.setattr(
                client_engine,
                "split_secret",
                lambda seed, t, n: [honest_split(seed, t, n)[0]] * n,
            )
            out.update(fed.exchange(stage, {dealer: requests[dealer]}))
        return out

    engine = SecAggServerEngine(
        SecAggConfig(num_shares=1.0, reconstruction_threshold=3), nodes, MASKED
    )
    # Execute / Assert
    with pytest.raises(SecAggRoundFailed, match=rf"node {dealer} dealt shares .* blamed"):
        run_secagg(engine, exchange)
    assert engine.blamed == {dealer}


# ------------------------------------------------- a malicious client's weight and update
SCALE = 1000.0  # what `secagg_config` sets for example weighting (secagg-max-weight)
EXAMPLE_SCALES = (("delta/", SCALE), ("meta/weight", SCALE))


def weighted_contributions(
    num_clients: int, seed: int, weight: float = 100.0, size: int = 600
) -> dict[int, dict[str, np.ndarray]]:
    """Example-weighted contributions: delta = weight x an update of norm about 0.25."""
    rng = np.random.default_rng(seed)
    return {
        int(u): {
            "delta/layer.lora_B": (weight * rng.normal(0, 0.01, size)).astype(np.float32),
            "meta/weight": np.array([weight], dtype=np.float32),
            "meta/count": np.array([1.0], dtype=np.float32),
        }
        for u in rng.choice(2**40, size=num_clients, replace=False) + 1
    }


def unclipped_quantize(vec: np.ndarray, clip: float, levels: int, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """A malicious client's quantizer: no clipping, any value mod 2^32 (no range proofs)."""
    scaled = rng.random(vec.shape) + vec * (levels / (2.0 * clip)) + levels / 2.0
    return (scaled.astype(np.uint64) % 2**32).astype(np.uint32)


def run_round(
    fed: Federation, cheat: int | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, np.ndarray], int]:
    """One SecAgg+ round of real engines (defaults plus example-weighting scales); ``cheat``
    encodes its input with :func:`unclipped_quantize`. Returns the unmasked sum and its size."""

    def exchange(stage: str, requests: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
        if stage != wire.STAGE_COLLECT or cheat is None:
            return fed.exchange(stage, requests)
        out = fed.exchange(stage, {u: r for u, r in requests.items() if u != cheat})
        with monkeypatch.context() as mp:
            mp.setattr(client_engine, "quantize", unclipped_quantize)
            out.update(fed.exchange(stage, {cheat: requests[cheat]}))
        return out

    nodes = sorted(fed.contributions)
    engine = SecAggServerEngine(SecAggConfig(key_scales=EXAMPLE_SCALES), nodes, MASKED)
    return run_secagg(engine, exchange), len(engine.contributors)


def test_a_client_claiming_weight_1e7_is_caught_by_the_aggregate_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One of five clients claims weight 1e7 (its honest peers: 100) and an update of its own.

    On main (RUN, 79c277a, the same round of real engines; main had no aggregate check) the
    unmasked sum carried summed weight 1.00004e7 and FedAvg's mean update
    (sum delta / sum weight) equalled the attacker's to 4.2e-5 relative: it dominated the
    round (script: the rounds below on main's engines, printing the sums). Now the sum's weight exceeds what five clients can honestly encode (5 x clipping
    range x scale = 40,000), and 5 x ``max-client-weight`` when that is set: the round is
    rejected; an honest round passes the same check."""
    # Prepare
    fed = Federation(weighted_contributions(5, 31))
    attacker = sorted(fed.contributions)[2]
    evil = np.full(600, 0.3, dtype=np.float32)
    fed.contributions[attacker] = {
        "delta/layer.lora_B": (1e7 * evil).astype(np.float32),
        "meta/weight": np.array([1e7], dtype=np.float32),
        "meta/count": np.array([1.0], dtype=np.float32),
    }
    # Execute
    summed, n = run_round(fed, attacker, monkeypatch)
    # Assert: the attack reached the sum (as on main), and the bound catches it
    mean = summed["delta/layer.lora_B"] / summed["meta/weight"][0]
    assert np.allclose(mean, evil, rtol=1e-3)
    cfg = SecAggConfig(key_scales=EXAMPLE_SCALES)
    default = SecAggPlusAggregator(cfg).check_bounds(summed, n)
    capped = SecAggPlusAggregator(cfg, RobustConfig(max_weight=500.0)).check_bounds(summed, n)
    assert default is not None and "max-client-weight=8000" in default
    assert capped is not None and "max-client-weight=500" in capped
    honest, n = run_round(Federation(weighted_contributions(5, 32)), None, monkeypatch)
    assert SecAggPlusAggregator(cfg, RobustConfig(max_weight=500.0)).check_bounds(honest, n) is None


def test_a_scaled_update_within_the_weight_is_caught_by_the_norm_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client keeps weight 100 but sends 100 x an update of norm 245 (peers: about 0.25).

    It needs no protocol deviation (its values stay in the clipping range), so on main it
    simply entered the sum (RUN as above: the mean update's norm was 49, the attacker's
    245 / 5). With ``max-update-norm = 1`` the sum's delta norm exceeds
    summed weight x 1 and the round is rejected; honest clients clipped to 1 pass."""
    fed = Federation(weighted_contributions(5, 33))
    attacker = sorted(fed.contributions)[0]
    fed.contributions[attacker]["delta/layer.lora_B"] = np.full(600, 100 * 10.0, np.float32)
    summed, n = run_round(fed, None, monkeypatch)
    bounds = RobustConfig(max_weight=500.0, max_update_norm=1.0)
    cfg = SecAggConfig(key_scales=EXAMPLE_SCALES)
    reason = SecAggPlusAggregator(cfg, bounds).check_bounds(summed, n)
    assert reason is not None and "max-update-norm=1" in reason
    # the honest client's half: clipped to the bound before masking, the sum passes
    clipped = {u: clip_contribution(c, bounds) for u, c in fed.contributions.items()}
    assert all(update_norm(c) <= 1.0 for c in clipped.values())
    honest, n = run_round(Federation(clipped), None, monkeypatch)
    assert SecAggPlusAggregator(cfg, bounds).check_bounds(honest, n) is None
