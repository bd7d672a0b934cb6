"""SecAgg+ protocol engines in process: exact sums, drop-out recovery, refusals, server view."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from fedge.clients.secagg.engine import SecAggClientEngine, SecAggProtocolError
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from fedge.secagg.crypto import generate_keypair
from fedge.server.secagg.engine import (
    KeyBook,
    SecAggRoundFailed,
    SecAggServerEngine,
    ring_neighbours,
)
from fedge.server.secagg.protocol import run_secagg

MASKED = "masked"


def plain_sum(fed, nodes) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    """Float64 sum of the given nodes' contributions."""
    keys = next(iter(fed.contributions.values())).keys()
    return {k: sum(fed.contributions[u][k].astype(np.float64) for u in nodes) for k in keys}


def quantization_bound(cfg: SecAggConfig, n: int) -> float:
    """Worst-case error of a sum of n stochastically rounded values: one level per client."""
    return n * 2 * cfg.clipping_range / cfg.quantization_range


def test_sum_matches_plain_sum_within_quantization_error(make_federation: Callable) -> None:
    # Prepare
    fed = make_federation(5, seed=1)
    cfg = SecAggConfig()
    engine = SecAggServerEngine(cfg, list(fed.contributions), MASKED, seed=3)
    # Execute
    got = run_secagg(engine, fed.exchange)
    # Assert
    want = plain_sum(fed, fed.contributions)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape
        assert np.max(np.abs(got[k] - want[k])) <= quantization_bound(cfg, 5)
    assert got["meta/count"][0] == pytest.approx(5.0, abs=quantization_bound(cfg, 5))


def test_key_scales_carry_large_weights(make_federation: Callable) -> None:
    # Prepare: example-weighted contributions, far outside the clipping range unscaled
    fed = make_federation(3, seed=2)
    for c in fed.contributions.values():
        c["meta/weight"] = np.array([700.0], dtype=np.float32)
        c["delta/layer.lora_B"] = c["delta/layer.lora_B"] * 700.0
    cfg = SecAggConfig(key_scales=(("meta/weight", 1000.0), ("delta/layer.lora_B", 1000.0)))
    # Execute
    got = run_secagg(SecAggServerEngine(cfg, list(fed.contributions), MASKED), fed.exchange)
    # Assert: the error scales with the divisor, nothing else changes
    want = plain_sum(fed, fed.contributions)
    assert got["meta/weight"][0] == pytest.approx(2100.0, abs=1000 * quantization_bound(cfg, 3))
    err = np.max(np.abs(got["delta/layer.lora_B"] - want["delta/layer.lora_B"]))
    assert err <= 1000 * quantization_bound(cfg, 3)


def test_dropouts_at_threshold_are_recovered_exactly(make_federation: Callable) -> None:
    # Prepare: 6 clients, everyone a neighbour of everyone, 3 of a node's 5 neighbours'
    # shares rebuild its seed, so 2 clients may vanish after sharing their keys
    fed = make_federation(6, seed=4)
    cfg = SecAggConfig(num_shares=1.0, reconstruction_threshold=3)
    nodes = sorted(fed.contributions)
    fed.silent[wire.STAGE_COLLECT] = {nodes[1], nodes[4]}
    engine = SecAggServerEngine(cfg, nodes, MASKED, seed=5)
    # Execute
    got = run_secagg(engine, fed.exchange)
    # Assert: the sum of the 4 survivors, masks of the 2 drop-outs removed
    survivors = [u for u in nodes if u not in fed.silent[wire.STAGE_COLLECT]]
    assert engine.contributors == survivors
    want = plain_sum(fed, survivors)
    for k in want:
        assert np.max(np.abs(got[k] - want[k])) <= quantization_bound(cfg, 4)


def test_dropout_during_unmask_is_tolerated(make_federation: Callable) -> None:
    # Prepare: one client sends its masked input, then goes silent in the unmask stage
    fed = make_federation(5, seed=6)
    cfg = SecAggConfig(num_shares=1.0, reconstruction_threshold=3)
    nodes = sorted(fed.contributions)
    fed.silent[wire.STAGE_UNMASK] = {nodes[2]}
    # Execute
    got = run_secagg(SecAggServerEngine(cfg, nodes, MASKED), fed.exchange)
    # Assert: its input is still in the sum (its self mask is rebuilt from shares)
    want = plain_sum(fed, nodes)
    assert np.max(
        np.abs(got["ctrl/layer.lora_B"] - want["ctrl/layer.lora_B"])
    ) <= quantization_bound(cfg, 5)


def test_unmask_asks_only_the_holders_the_thresholds_need(make_federation: Callable) -> None:
    # Prepare: 12 clients, everyone a neighbour, threshold 8 (+1 spare) of 11 neighbours;
    # a node's own share does not exist, so each asked node needs 9 other asked nodes
    fed = make_federation(12, seed=19, size=200)
    cfg = SecAggConfig(num_shares=1.0, reconstruction_threshold=8)
    nodes = sorted(fed.contributions)
    # Execute
    got = run_secagg(SecAggServerEngine(cfg, nodes, MASKED), fed.exchange)
    # Assert: 10 of the 12 are asked, in one exchange, and the sum is exact
    asked = [node for stage, node, _ in fed.received if stage == wire.STAGE_UNMASK]
    assert len(asked) == 10
    want = plain_sum(fed, nodes)
    assert np.max(np.abs(got["delta/layer.lora_B"] - want["delta/layer.lora_B"])) <= (
        quantization_bound(cfg, 12)
    )


def test_silent_unmask_holders_make_the_server_ask_the_rest(make_federation: Callable) -> None:
    # Prepare: 12 clients, threshold 8; two of the first 9 holders go silent at unmask
    fed = make_federation(12, seed=20, size=200)
    cfg = SecAggConfig(num_shares=1.0, reconstruction_threshold=8)
    nodes = sorted(fed.contributions)
    # (the first holders depend only on the graph: a dry run of the same ring finds them)
    dry = make_federation(12, seed=20, size=200)
    probe = SecAggServerEngine(cfg, nodes, MASKED, seed=21)
    probe.receive_public_keys(dry.exchange(wire.STAGE_ADVERTISE, probe.advertise_requests()))
    probe.receive_masked_inputs(dry.exchange(wire.STAGE_COLLECT, probe.collect_requests()))
    silent = sorted(probe.unmask_requests())[:2]
    fed.silent[wire.STAGE_UNMASK] = set(silent)
    # Execute
    got = run_secagg(SecAggServerEngine(cfg, nodes, MASKED, seed=21), fed.exchange)
    # Assert: a second unmask exchange asked the other three; the sum is exact
    asked = [node for stage, node, _ in fed.received if stage == wire.STAGE_UNMASK]
    assert len(asked) == 12 - 2 and not set(asked) & set(silent)
    want = plain_sum(fed, nodes)
    assert np.max(np.abs(got["delta/layer.lora_B"] - want["delta/layer.lora_B"])) <= (
        quantization_bound(cfg, 12)
    )


def test_below_threshold_the_round_fails_without_a_sum(make_federation: Callable) -> None:
    # Prepare: 3 of 6 vanish after key sharing, one more than threshold 4 tolerates
    fed = make_federation(6, seed=7)
    cfg = SecAggConfig(num_shares=1.0, reconstruction_threshold=4)
    nodes = sorted(fed.contributions)
    fed.silent[wire.STAGE_COLLECT] = set(nodes[:3])
    engine = SecAggServerEngine(cfg, nodes, MASKED)
    # Execute / Assert
    with pytest.raises(SecAggRoundFailed, match=r"below its threshold 4.*no aggregate is applied"):
        run_secagg(engine, fed.exchange)


def test_too_few_clients_in_an_early_stage_fail_the_round(make_federation: Callable) -> None:
    # Prepare: only one client answers the setup stage
    fed = make_federation(3, seed=8)
    nodes = sorted(fed.contributions)
    fed.silent[wire.STAGE_ADVERTISE] = set(nodes[1:])
    # Execute / Assert
    with pytest.raises(SecAggRoundFailed, match=r"only 1 client.*hold SecAgg\+ keys"):
        run_secagg(SecAggServerEngine(SecAggConfig(), nodes, MASKED), fed.exchange)


def test_server_receives_nothing_that_reveals_an_individual_input(
    make_federation: Callable,
) -> None:
    # Prepare
    fed = make_federation(4, seed=9, size=2000)
    nodes = sorted(fed.contributions)
    fed.silent[wire.STAGE_COLLECT] = {nodes[3]}  # a drop-out makes the server rebuild its masks
    cfg = SecAggConfig(num_shares=1.0, reconstruction_threshold=2)
    # Execute
    run_secagg(SecAggServerEngine(cfg, nodes, MASKED), fed.exchange)
    # Assert: no received array correlates with any client's input; no raw float bytes appear
    for stage, node, reply in fed.received:
        for record in reply.array_records.values():
            for name, arr in record.items():
                seen = arr.numpy().astype(np.float64).reshape(-1)
                for u, contrib in fed.contributions.items():
                    truth = contrib[name].astype(np.float64).reshape(-1)
                    if truth.size < 100:
                        continue
                    corr = np.corrcoef(seen, truth)[0, 1]
                    assert abs(corr) < 0.15, (stage, node, u, name, corr)
        for record in reply.config_records.values():
            blobs = [v for v in record.values() if isinstance(v, bytes)]
            blobs += [
                x for v in record.values() if isinstance(v, list) for x in v if isinstance(x, bytes)
            ]
            for blob in blobs:
                for contrib in fed.contributions.values():
                    assert contrib["delta/layer.lora_B"].tobytes()[:64] not in blob


def test_client_refuses_stages_out_of_order() -> None:
    # Prepare: a fresh client gets a collect-stage message without having advertised keys
    engine = SecAggClientEngine(7, ConfigRecord())
    rec = {wire.KEY_STAGE: wire.STAGE_COLLECT, wire.KEY_SESSION: "s", wire.KEY_ROUND: "r"}
    content = RecordDict({wire.SECAGG_RECORD: ConfigRecord(rec)})
    # Execute / Assert
    with pytest.raises(SecAggProtocolError, match="ask it to advertise keys"):
        engine.handle(content, dict)


def collected(fed, cfg: SecAggConfig, keys: KeyBook | None = None) -> SecAggServerEngine:  # type: ignore[no-untyped-def]
    """An engine whose round ran up to (not including) the unmask stage."""
    engine = SecAggServerEngine(cfg, sorted(fed.contributions), MASKED, keys=keys)
    advertise = engine.advertise_requests()
    if advertise:
        engine.receive_public_keys(fed.exchange(wire.STAGE_ADVERTISE, advertise))
    engine.receive_masked_inputs(fed.exchange(wire.STAGE_COLLECT, engine.collect_requests()))
    return engine


def unmask_request(engine: SecAggServerEngine, active: list[int], dropped: list[int]) -> RecordDict:
    """A hand-made unmask request (what a malicious server could send)."""
    rec = ConfigRecord(
        {
            wire.KEY_STAGE: wire.STAGE_UNMASK,
            wire.KEY_SESSION: engine.keys.session,
            wire.KEY_ROUND: engine.round_id,
            wire.KEY_ACTIVE: wire.pack_ids(active),
            wire.KEY_DROPPED: wire.pack_ids(dropped),
            wire.KEY_SOURCES: wire.pack_ids([]),
            wire.KEY_CIPHERTEXTS: [],
        }
    )
    return RecordDict({wire.SECAGG_RECORD: rec})


def test_client_refuses_to_reveal_both_secrets_of_a_node(make_federation: Callable) -> None:
    # Prepare: run to the unmask stage, then ask client A for B's seed share AND pair seed
    fed = make_federation(3, seed=10)
    engine = collected(fed, SecAggConfig(num_shares=1.0))
    a, b, c = sorted(fed.contributions)
    # Execute / Assert
    with pytest.raises(SecAggProtocolError, match="both live and dropped"):
        SecAggClientEngine(a, fed.states[a]).handle(unmask_request(engine, [a, b, c], [b]), dict)
    # and a second unmask of the same round is refused too (one reveal per round)
    with pytest.raises(SecAggProtocolError, match="then one unmask"):
        SecAggClientEngine(a, fed.states[a]).handle(unmask_request(engine, [a, c], [b]), dict)


def test_client_refuses_to_unmask_below_its_threshold(make_federation: Callable) -> None:
    # Prepare: 5 clients, threshold 3; the server says only A and B are alive
    fed = make_federation(5, seed=13)
    engine = collected(fed, SecAggConfig(num_shares=1.0, reconstruction_threshold=3))
    a, b, *rest = sorted(fed.contributions)
    # Execute / Assert
    with pytest.raises(SecAggProtocolError, match="below the threshold 3"):
        SecAggClientEngine(a, fed.states[a]).handle(unmask_request(engine, [a, b], rest), dict)


def test_keys_are_agreed_once_and_rounds_take_two_exchanges(make_federation: Callable) -> None:
    # Prepare: one key book for the run, three rounds
    fed = make_federation(4, seed=14)
    book = KeyBook()
    cfg = SecAggConfig()
    want = plain_sum(fed, fed.contributions)
    for _ in range(3):
        # Execute
        got = run_secagg(
            SecAggServerEngine(cfg, list(fed.contributions), MASKED, keys=book), fed.exchange
        )
        # Assert: every round is exact
        assert np.max(
            np.abs(got["delta/layer.lora_B"] - want["delta/layer.lora_B"])
        ) <= quantization_bound(cfg, 4)
    stages = [stage for stage, _, _ in fed.received]
    assert stages.count(wire.STAGE_ADVERTISE) == 4  # once per node, first round only
    assert stages.count(wire.STAGE_COLLECT) == stages.count(wire.STAGE_UNMASK) == 12


def test_pair_secrets_are_computed_once_per_session(
    make_federation: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: count the X25519 agreements clients run over three rounds of one session
    import fedge.clients.secagg.engine as client_engine

    computed: list[int] = []
    real = client_engine.shared_secrets

    def counting(private: bytes, publics: list[bytes]) -> list[bytes]:
        computed.append(len(publics))
        return real(private, publics)

    monkeypatch.setattr(client_engine, "shared_secrets", counting)
    fed = make_federation(5, seed=17)
    book = KeyBook()
    # Execute
    for _ in range(3):
        run_secagg(
            SecAggServerEngine(
                SecAggConfig(num_shares=1.0), sorted(fed.contributions), MASKED, keys=book
            ),
            fed.exchange,
        )
    # Assert: 4 neighbours x 2 key pairs per node, all in the first round
    assert sum(computed) == 5 * 4 * 2


def test_a_share_reflected_to_its_sender_is_refused(make_federation: Callable) -> None:
    # Prepare: run to unmask; hand C the share C sealed for B, claiming B sent it to C
    # (both directions of a pair share one key: only the sealed addressees tell them apart)
    fed = make_federation(3, seed=18)
    engine = collected(fed, SecAggConfig(num_shares=1.0))
    a, b, c = sorted(fed.contributions)
    sealed_by_c_for_b = dict(engine._r.forward[b])[c]
    request = unmask_request(engine, [a, b, c], [])
    request[wire.SECAGG_RECORD][wire.KEY_SOURCES] = wire.pack_ids([b])
    request[wire.SECAGG_RECORD][wire.KEY_CIPHERTEXTS] = [sealed_by_c_for_b]
    # Execute / Assert
    with pytest.raises(SecAggProtocolError, match="does not decrypt as addressed"):
        SecAggClientEngine(c, fed.states[c]).handle(request, dict)


def test_client_refuses_a_replayed_round_and_a_swapped_key(make_federation: Callable) -> None:
    # Prepare: a finished round, then the same collect requests again
    fed = make_federation(3, seed=15)
    book = KeyBook()
    engine = SecAggServerEngine(SecAggConfig(), sorted(fed.contributions), MASKED, keys=book)
    engine.receive_public_keys(fed.exchange(wire.STAGE_ADVERTISE, engine.advertise_requests()))
    requests = engine.collect_requests()
    fed.exchange(wire.STAGE_COLLECT, requests)
    a = sorted(fed.contributions)[0]
    client = SecAggClientEngine(a, fed.states[a])
    # Execute / Assert: replaying a round id would repeat the pairwise masks
    with pytest.raises(SecAggProtocolError, match="already used"):
        client.handle(requests[a], lambda: fed.contributions[a])
    # a new round in which the server swaps a neighbour's public key
    fresh = SecAggServerEngine(SecAggConfig(), sorted(fed.contributions), MASKED, keys=book)
    swapped = fresh.collect_requests()[a]
    rec = swapped[wire.SECAGG_RECORD]
    rec[wire.KEY_PEER_PK1] = [
        generate_keypair()[1],
        *wire.get_bytes_list(rec, wire.KEY_PEER_PK1)[1:],
    ]
    with pytest.raises(SecAggProtocolError, match=r"public keys of node .* changed"):
        client.handle(swapped, lambda: fed.contributions[a])


def test_client_refuses_a_threshold_of_half_its_neighbourhood(make_federation: Callable) -> None:
    # Prepare: 4 clients, everyone a neighbour; the server sends threshold 1 of 3 neighbours
    fed = make_federation(4, seed=16)
    engine = SecAggServerEngine(SecAggConfig(num_shares=1.0), sorted(fed.contributions), MASKED)
    engine.receive_public_keys(fed.exchange(wire.STAGE_ADVERTISE, engine.advertise_requests()))
    a = sorted(fed.contributions)[0]
    request = engine.collect_requests()[a]
    request[wire.SECAGG_RECORD][wire.KEY_THRESHOLD] = 1
    # Execute / Assert
    with pytest.raises(SecAggProtocolError, match="not more than half"):
        SecAggClientEngine(a, fed.states[a]).handle(request, lambda: fed.contributions[a])


def test_ring_neighbours_is_a_regular_graph() -> None:
    # Prepare / Execute: 50 nodes, neighbourhoods of 13 (self included)
    graph = ring_neighbours(list(range(100, 150)), num_shares=13, seed=0)
    # Assert: 12 neighbours each, symmetric
    assert {len(v) for v in graph.values()} == {12}
    assert all(u in graph[v] for u, nb in graph.items() for v in nb)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_shares": 1.5}, "num_shares=1.5"),
        ({"reconstruction_threshold": 0}, "reconstruction_threshold=0"),
        ({"reconstruction_threshold": 0.5}, "must be in \\(0.5, 1\\]"),
        ({"modulus_range": 1000}, "modulus_range=1000"),
        ({"quantization_range": 2**32}, "quantization_range"),
        ({"key_scales": (("meta/weight", 0.0),)}, "key_scales"),
    ],
)
def test_config_rejects_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SecAggConfig(**kwargs)


def test_capacity_check_names_the_overflow() -> None:
    with pytest.raises(ValueError, match="would overflow"):
        SecAggConfig(quantization_range=2**30).check_capacity(8)


@pytest.mark.parametrize("threshold", [1, 3, 5])
def test_shamir_shares_rebuild_only_from_threshold_many(threshold: int) -> None:
    # Prepare
    from fedge.secagg.crypto import combine_secret, split_secret

    secret = bytes(range(32))
    shares = split_secret(secret, threshold, 5)
    # Execute / Assert: any threshold-many rebuild it; fewer give something else
    assert combine_secret(shares[-threshold:]) == secret
    if threshold > 1:
        try:
            wrong = combine_secret(shares[: threshold - 1])
        except ValueError:
            wrong = b""
        assert wrong != secret


def test_ffa_frozen_keys_are_not_uploaded_and_must_be_zero(make_federation: Callable) -> None:
    # Prepare: every client has an all-zero lora_A delta (FFA-LoRA froze A)
    fed = make_federation(3, seed=11)
    for c in fed.contributions.values():
        c["delta/layer.lora_A"] = np.zeros((20, 5), np.float32)
    nodes = sorted(fed.contributions)
    omit = ["delta/layer.lora_A"]
    # Execute
    got = run_secagg(
        SecAggServerEngine(SecAggConfig(), nodes, MASKED, omit_zero=omit), fed.exchange
    )
    # Assert: the key never travelled, the rest is the exact sum
    assert "delta/layer.lora_A" not in got
    for stage, _, reply in fed.received:
        for record in reply.array_records.values():
            assert "delta/layer.lora_A" not in record, stage
    want = plain_sum(fed, nodes)
    assert np.max(
        np.abs(got["delta/layer.lora_B"] - want["delta/layer.lora_B"])
    ) <= quantization_bound(SecAggConfig(), 3)


def test_a_client_refuses_to_drop_a_nonzero_frozen_key(make_federation: Callable) -> None:
    # Prepare: one client trained lora_A although the round says it is frozen
    fed = make_federation(3, seed=12)
    for c in fed.contributions.values():
        c["delta/layer.lora_A"] = np.zeros((20, 5), np.float32)
    nodes = sorted(fed.contributions)
    fed.contributions[nodes[0]]["delta/layer.lora_A"][0, 0] = 1e-3
    engine = SecAggServerEngine(SecAggConfig(), nodes, MASKED, omit_zero=["delta/layer.lora_A"])
    # Execute / Assert
    with pytest.raises(SecAggProtocolError, match="must be zero"):
        run_secagg(engine, fed.exchange)
