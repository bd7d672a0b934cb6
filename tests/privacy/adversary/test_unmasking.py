"""Active-server unmasking attacks on the real SecAgg+ client engine.

A scripted server (``attacker``) sends crafted stage messages to fedge's client engines
and computes what it can from the replies. Attacks 1 (empty neighbourhood), 2 (invented
neighbour) and 3 (inconsistent drop-out lists) recovered the victim's exact input when
run against the code before the fix (commit 23d54ee, 2026-12-02), and so did the new-session
variant of attack 2 (run there by a script in a temporary worktree); the non-finite-number
case is read from that code, not run. Now the victim's input stays masked and a client
refuses, naming the rule it applies.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, RecordDict

from fedge.clients.secagg.engine import ClientRules, SecAggProtocolError
from fedge.clients.secagg.rules import check_neighbourhood, check_unmask
from fedge.secagg import wire
from fedge.secagg.config import MAX_NEIGHBOURS, SecAggConfig
from fedge.secagg.crypto import (
    SHARE_PURPOSE,
    derive,
    generate_keypair,
    pair_info,
    seal,
    shared_secrets,
    split_secret,
    unseal,
)
from fedge.server.secagg.engine import SecAggServerEngine
from tests.privacy.adversary import attacker as atk


def masked_of(reply: RecordDict) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in reply.array_records[atk.MASKED].items()}


def test_attack1_an_empty_neighbourhood_with_threshold_1_is_refused() -> None:
    """Attack 1: no neighbours, threshold 1: the only share of the self-mask seed is the seed.

    On main the collect passed and the unmask handed the share over: recovered exactly.
    """
    # Prepare
    v, states, secret = 11, {}, atk.secret_input(1)
    atk.engine(v, states).handle(atk.advertise_record("s"), lambda: secret)
    refusals, recovered = [], None
    # Execute
    try:
        reply = atk.engine(v, states).handle(
            atk.collect_record([], [], [], 1, "s", "r1"), lambda: secret
        )
        un = atk.engine(v, states).handle(atk.unmask_record("s", "r1", [v], [], []), dict)
        shares, seeds = atk.revealed([(v, un)])
        recovered = atk.recover(v, masked_of(reply), [], shares.get(v, []), seeds)
    except SecAggProtocolError as exc:
        refusals.append(str(exc))
    # Assert
    assert not atk.matches(recovered, secret)
    assert refusals and "neighbour" in refusals[0]


def test_attack3_inconsistent_dropout_lists_reveal_nothing_usable() -> None:
    """Attack 3, default SecAggConfig with three clients and honest keys, no collusion.

    The victim is told "A dropped" (self-mask share and s(v, A)), A is told "v is live"
    (A's share of v's seed), B is told "v dropped" (s(B, v)). On main each message passed
    its own checks, the victim's own share counted, and the input was recovered exactly.
    """
    # Prepare: an honest advertise + collect through the real server engine
    fed = {101: atk.secret_input(2), 102: atk.secret_input(3), 103: atk.secret_input(4)}
    states: dict[int, ConfigRecord] = {}
    server = SecAggServerEngine(SecAggConfig(), sorted(fed), atk.MASKED)

    def ask(node: int, content: RecordDict) -> RecordDict:
        return atk.engine(node, states).handle(content, lambda: fed[node])

    server.receive_public_keys({u: ask(u, r) for u, r in server.advertise_requests().items()})
    collected = {u: ask(u, r) for u, r in server.collect_requests().items()}
    server.receive_masked_inputs(collected)
    v, a, b = sorted(fed)
    session, round_id = server.keys.session, server.round_id
    fwd = {u: dict(server._r.forward[u]) for u in fed}  # what each holder was sent, by source
    # Execute: the three inconsistent unmask messages
    replies, refusals = [], []
    plan = [
        (v, [v, b], [a], [(b, fwd[v][b])]),  # v: "A dropped"
        (a, [a, v, b], [], [(v, fwd[a][v])]),  # A: "v is live"
        (b, [b, a], [v], [(a, fwd[b][a])]),  # B: "v dropped"
    ]
    for node, active, dropped, forwarded in plan:
        try:
            content = atk.unmask_record(session, round_id, active, dropped, forwarded)
            replies.append((node, ask(node, content)))
        except SecAggProtocolError as exc:
            refusals.append(str(exc))
    shares, seeds = atk.revealed(replies)
    recovered = atk.recover(v, masked_of(collected[v]), [a, b], shares.get(v, []), seeds)
    # Assert
    assert not atk.matches(recovered, fed[v])
    assert any("live neighbours" in why for why in refusals)


def optimal_attack(n: int, t: int) -> tuple[bool, list[str], int]:
    """The best split of views for a victim with ``n`` neighbours and threshold ``t``.

    The server tells the victim that the most neighbours it can (``n - t``) dropped, so
    it learns those pair seeds from the victim; tells the others "v dropped", so they
    reveal the remaining pair seeds; and tells the first group "v is live" to collect
    their shares of v's self-mask seed. Returns (recovered, refusals, shares collected).
    """
    victim, hood = 500, list(range(501, 502 + n - 1))
    fed = {u: atk.secret_input(u) for u in [victim, *hood]}
    states: dict[int, ConfigRecord] = {}
    cfg = SecAggConfig(num_shares=n + 1, reconstruction_threshold=n)
    server = SecAggServerEngine(cfg, sorted(fed), atk.MASKED)

    def ask(node: int, content: RecordDict) -> RecordDict:
        return atk.engine(node, states).handle(content, lambda: fed[node])

    server.receive_public_keys({u: ask(u, r) for u, r in server.advertise_requests().items()})
    requests = server.collect_requests()
    graph = wire.unpack_graph(wire.get_bytes(requests[victim][wire.SECAGG_RECORD], wire.KEY_GRAPH))
    graph = wire.pack_graph({u: (t, hood_u) for u, (_, hood_u) in graph.items()})
    for req in requests.values():  # the attacker's threshold, past its own engine's check
        req[wire.SECAGG_RECORD][wire.KEY_THRESHOLD] = t
        req[wire.SECAGG_RECORD][wire.KEY_GRAPH] = graph  # one graph for all: masks cancel
    collected = {u: ask(u, r) for u, r in requests.items()}
    server.receive_masked_inputs(collected)
    fwd = {u: dict(server._r.forward.get(u, [])) for u in fed}
    told_dropped = hood[: n - t]  # the victim reveals these pair seeds
    told_v_dropped = hood[n - t :]  # these reveal their pair seeds with the victim
    replies, refusals = [], []
    everyone = [victim, *hood]
    views = {victim: ([u for u in everyone if u not in told_dropped], told_dropped)}
    for u in told_dropped:
        views[u] = (everyone, [])
    for u in told_v_dropped:
        views[u] = ([w for w in everyone if w != victim], [victim])
    for node, (active, dropped) in views.items():
        forwarded = [(src, ct) for src, ct in fwd[node].items() if src in active and src != node]
        try:
            content = atk.unmask_record(
                server.keys.session, server.round_id, active, dropped, forwarded
            )
            replies.append((node, ask(node, content)))
        except SecAggProtocolError as exc:
            refusals.append(str(exc))
    shares, seeds = atk.revealed(replies)
    got = shares.get(victim, [])
    recovered = atk.recover(victim, masked_of(collected[victim]), hood, got, seeds)
    return atk.matches(recovered, fed[victim]), refusals, len(got)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_attack3_fails_for_every_threshold_a_client_accepts(n: int) -> None:
    """Attack 3 at its best, for each neighbourhood size and every threshold clients accept.

    A threshold a client refuses (half the neighbours or fewer) is refused at collect; for
    every accepted one the server ends with fewer shares of the victim's seed than it needs.
    """
    for t in range(1, n + 1):
        if 2 * t <= n:
            with pytest.raises(SecAggProtocolError, match="more than half"):
                optimal_attack(n, t)
            continue
        recovered, refusals, got = optimal_attack(n, t)
        assert not recovered
        assert got < t, (n, t, got, refusals)


def passes(check: Callable[..., None], *args: object) -> bool:
    """Whether a client rule lets a message through (it raises to refuse)."""
    try:
        check(*args)
    except SecAggProtocolError:
        return False
    return True


def neighbour_views(v: int, w: int) -> tuple[bool, bool, bool]:
    """Neighbour ``w`` of victim ``v``, in the neighbourhood most favourable to the server
    (MAX_NEIGHBOURS nodes, the lowest threshold it accepts): does it unmask when told "v is
    live" (revealing its share of v's seed), when told "v dropped" (revealing its pair seed
    with v), and when told both?"""
    others = [v, *range(10_000, 10_000 + MAX_NEIGHBOURS - 1)]
    t = MAX_NEIGHBOURS // 2 + 1
    live = passes(check_unmask, w, others, t, [w, *others], [], [v])
    dropped = passes(check_unmask, w, others, t, [w, *others[1:]], [v], [])
    both = passes(check_unmask, w, others, t, [w, *others], [v], [v])
    return live, dropped, both


def test_attack3_fails_for_every_neighbourhood_and_threshold_the_configuration_allows() -> None:
    """Attack 3 against the client's own rules, every neighbourhood size 0 to MAX_NEIGHBOURS + 1
    and every threshold 0 to n + 1 (the real engines above cover n <= 6; beyond, the rules they
    apply, ``check_neighbourhood`` and ``check_unmask``, are called directly: cheap).

    Victim v with n neighbours, the server's best split: v is told d neighbours dropped (it
    reveals those pair seeds), those d are told "v is live" (each reveals its share of v's
    seed), the other n - d "v dropped" (each reveals its pair seed). The rules must accept a
    collect exactly when n <= MAX_NEIGHBOURS and n/2 < t <= n, let v unmask exactly when
    n - d >= t, let a neighbour unmask with either view but never with v both live and
    dropped (one unmask per round is the engine's, tested in tests/secagg); then the server
    holds d <= n - t < t shares of v's seed: never the seed with all its pair seeds.
    """
    v = 0
    assert neighbour_views(v, 1) == (True, True, False)  # each neighbour: one secret of v
    for n in range(MAX_NEIGHBOURS + 2):
        hood = list(range(1, n + 1))
        for t in range(n + 2):
            accepted = passes(check_neighbourhood, v, hood, t, ClientRules())
            assert accepted == (1 <= n <= MAX_NEIGHBOURS and n < 2 * t and t <= n), (n, t)
            if not accepted:
                continue
            best = -1  # the most shares of v's seed with every pair seed known
            for d in range(n + 1):
                told_dropped, told_live = hood[:d], hood[d:]
                victim = passes(check_unmask, v, hood, t, [v, *told_live], told_dropped, told_live)
                assert victim == (n - d >= t), (n, t, d)
                if victim:
                    best = max(best, d)  # d told "v is live", the n - d others "v dropped"
            assert 0 <= best < t, (n, t, best)


def server_keys() -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """Two X25519 key pairs the server made for a neighbour it invents."""
    return generate_keypair(), generate_keypair()


def test_attack2_an_invented_neighbour_is_refused() -> None:
    """Attack 2: the server invents a neighbour with its own keys (k = 2, t = 2).

    It opens the share sealed to the invented node, asks the victim for its own share at
    unmask and computes the pair seed itself. On main: recovered exactly.
    """
    # Prepare
    v, fake, states, secret = 21, 22, {}, atk.secret_input(5)
    (sk1, pk1), (sk2, pk2) = server_keys()
    adv = atk.engine(v, states).handle(atk.advertise_record("s"), lambda: secret)
    vrec = adv.config_records[wire.SECAGG_RECORD]
    refusals, recovered = [], None
    rules = ClientRules(
        trusted=frozenset({Ed25519PrivateKey.generate().public_key().public_bytes_raw()})
    )
    collect = atk.collect_record(
        [fake], [pk1], [pk2], 1, "s", "r1", atk.forged_identity(fake, "s", pk1, pk2), node=v
    )
    # Execute
    try:
        reply = atk.engine(v, states, rules).handle(collect, lambda: secret)
        s1 = shared_secrets(sk1, [wire.get_bytes(vrec, wire.KEY_PK1)])[0]
        s2 = shared_secrets(sk2, [wire.get_bytes(vrec, wire.KEY_PK2)])[0]
        key = derive(s2, pair_info(SHARE_PURPOSE, fake, v, "r1"))
        ct = reply.config_records[wire.SECAGG_RECORD][wire.KEY_CIPHERTEXTS][0]
        opened = unseal(key, ct, wire.pack_ids([v, fake]))
        mine = split_secret(b"x", 2, 2)[1]  # any well-formed share "from" the invented node
        fwd = [(fake, seal(key, mine, wire.pack_ids([fake, v])))]
        un = atk.engine(v, states, rules).handle(
            atk.unmask_record("s", "r1", [v, fake], [], fwd), dict
        )
        shares, _ = atk.revealed([(v, un)])
        seeds = {frozenset((v, fake)): atk.pair_seed(s1, v, fake, "r1", collect)}
        recovered = atk.recover(v, masked_of(reply), [fake], [opened, *shares.get(v, [])], seeds)
    except SecAggProtocolError as exc:
        refusals.append(str(exc))
    # Assert
    assert not atk.matches(recovered, secret)
    assert refusals and "trust list" in refusals[0]


def test_attack2_a_new_session_cannot_replace_a_pinned_identity() -> None:
    """Attack 2 through a new key session, posing as known neighbours (k = 3, t = 2).

    RUN on 23d54ee (a script in a temporary worktree, that code's own wire format): after an
    honest session in which the victim pinned A and B, an advertise of a new session cleared
    the pins, the victim accepted a collect naming A and B with key pairs the server made,
    and the server opened both shares sealed to them, rebuilt the self-mask seed (t = 2),
    derived both pair seeds and recovered the input to 3.3e-6 (one quantization level is
    3.8e-6) without sending any unmask message. Now pinned identities span sessions."""
    # Prepare: an honest session in which the victim pins both neighbours' identities
    fed = {31: atk.secret_input(6), 32: atk.secret_input(7), 33: atk.secret_input(8)}
    states: dict[int, ConfigRecord] = {}
    server = SecAggServerEngine(SecAggConfig(), sorted(fed), atk.MASKED)

    def ask(node: int, content: RecordDict) -> RecordDict:
        return atk.engine(node, states).handle(content, lambda: fed[node])

    server.receive_public_keys({u: ask(u, r) for u, r in server.advertise_requests().items()})
    server.receive_masked_inputs({u: ask(u, r) for u, r in server.collect_requests().items()})
    v, a, b = sorted(fed)
    # Execute: a new session; the server poses as A and B with keys and identities it made
    ask(v, atk.advertise_record("s2"))
    (_, pk1), (_, pk2) = server_keys()
    (_, qk1), (_, qk2) = server_keys()
    forged_a = atk.forged_identity(a, "s2", pk1, pk2)
    forged_b = atk.forged_identity(b, "s2", qk1, qk2)
    extra = {
        wire.KEY_PEER_IDENTITY: [
            *forged_a[wire.KEY_PEER_IDENTITY],
            *forged_b[wire.KEY_PEER_IDENTITY],
        ],  # type: ignore[misc]
        wire.KEY_PEER_SIGNATURE: [
            *forged_a[wire.KEY_PEER_SIGNATURE],
            *forged_b[wire.KEY_PEER_SIGNATURE],
        ],  # type: ignore[misc]
    }
    collect = atk.collect_record([a, b], [pk1, qk1], [pk2, qk2], 2, "s2", "r2", extra, node=v)
    # Assert
    with pytest.raises(SecAggProtocolError, match="never replaced"):
        ask(v, collect)


def test_a_non_finite_number_in_a_collect_message_is_refused() -> None:
    """NaN or infinite protocol numbers made comparisons false on main (read from its code);
    now they are refused."""
    v, states = 41, {}
    atk.engine(v, states).handle(atk.advertise_record("s"), dict)
    for key, value in (
        (wire.KEY_THRESHOLD, float("nan")),
        (wire.KEY_CLIPPING_RANGE, float("inf")),
        (wire.KEY_MODULUS_RANGE, 3),
        (wire.KEY_QUANTIZATION_RANGE, float("inf")),
    ):
        collect = atk.collect_record([], [], [], 1, "s", f"r-{key}", {key: value})
        with pytest.raises(SecAggProtocolError, match="finite and in range"):
            atk.engine(v, states).handle(collect, dict)
