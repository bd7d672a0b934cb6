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

import clients.secagg.engine as client_engine
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from server.secagg.engine import SecAggRoundFailed, SecAggServerEngine
from server.secagg.protocol import run_secagg
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
