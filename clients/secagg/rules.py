"""What a SecAgg+ client requires of a round before it sends anything: its rules and the checks.

The rules come from the node's own policy (``fedge.clients.privacy.policy``), never from the
server; the checks refuse a collect message whose numbers are not finite and in range,
whose neighbourhood or threshold would let a server rebuild both secrets of a node (the
argument is in ``fedge.clients.secagg.engine``), or whose neighbours' keys are not signed by
a trusted identity, or by the one pinned for that node id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import ConfigRecord

from fedge.clients.secagg.pins import PinStore
from fedge.errors import FedgeError
from fedge.secagg import identity as ident
from fedge.secagg import wire
from fedge.secagg.config import MAX_NEIGHBOURS

# State fields of the identity pins: packed node ids and their identity keys, never cleared.
PIN_FIELDS = ("identity-pins", "identity-pin-keys")


class SecAggProtocolError(FedgeError):
    """A SecAgg+ stage message was out of order, malformed or unsafe; the client refuses it."""


@dataclass(frozen=True)
class ClientRules:
    """What this node requires of a SecAgg+ round, from its own policy, never from the server."""

    min_neighbours: int = 1  # fewer neighbours are refused (never 0: its seed would be its share)
    min_threshold: int = 1  # a lower reconstruction threshold is refused
    trusted: frozenset[bytes] | None = None  # Ed25519 keys of accepted neighbours (None: any)

    def __post_init__(self) -> None:
        """Reject rules that would let an empty or unmaskable neighbourhood through."""
        if self.min_neighbours < 1 or self.min_threshold < 1:
            raise ValueError(
                f"SecAgg+ rules: min-neighbours={self.min_neighbours} and min-threshold="
                f"{self.min_threshold} must be >= 1"
            )


def check_neighbourhood(
    node_id: int, neighbours: list[int], threshold: int, rules: ClientRules
) -> None:
    """Refuse a neighbourhood this node's rules do not allow: too small, or a threshold
    at or below half of it (then one server could hold both secrets of a node)."""
    n = len(neighbours)
    if node_id in neighbours or len(set(neighbours)) != n:
        raise SecAggProtocolError("collect message lists this node or a node twice as neighbour")
    if n > MAX_NEIGHBOURS:
        raise SecAggProtocolError(
            f"{n} neighbours, more than the {MAX_NEIGHBOURS} a client accepts (rule: the "
            "neighbourhoods whose unmask rule is tested, docs/privacy.md); refusing"
        )
    if n < rules.min_neighbours:
        raise SecAggProtocolError(
            f"{n} neighbours, fewer than this node's secagg-min-neighbours "
            f"{rules.min_neighbours} (rule: at least one neighbour, else its self-mask "
            "seed would be its only share); refusing"
        )
    if not 2 * threshold > n or threshold > n:
        raise SecAggProtocolError(
            f"threshold {threshold} is not more than half of this node's {n} neighbours (or "
            "exceeds them); with it the server could rebuild both secrets of a node, so it "
            "refuses"
        )
    if threshold < rules.min_threshold:
        raise SecAggProtocolError(
            f"threshold {threshold} is below this node's secagg-min-threshold "
            f"{rules.min_threshold}; refusing"
        )


def check_graph(node_id: int, neighbours: list[int], threshold: int, blob: bytes) -> None:
    """Refuse a round graph that is malformed, asymmetric or disagrees with this node's own
    neighbourhood and threshold. The graph is in the contribution digest: a client that was
    sent another graph than its neighbours masks under other pair seeds than they do."""
    try:
        graph = wire.unpack_graph(blob)
    except ValueError as exc:
        raise SecAggProtocolError(f"collect message: {exc}; refusing") from exc
    if graph.get(node_id) != (threshold, sorted(neighbours)):
        raise SecAggProtocolError(
            "collect message: the round graph does not give this node the neighbours and "
            "threshold it was sent (rule: one graph for the whole round); refusing"
        )
    for u, (_, hood) in graph.items():
        if any(v not in graph or u not in graph[v][1] for v in hood):
            raise SecAggProtocolError(
                "collect message: the round graph is not symmetric (rule: a pair masks both "
                "ways); refusing"
            )


def check_unmask(
    node_id: int,
    neighbours: list[int],
    threshold: int,
    active: list[int],
    dropped: list[int],
    sources: list[int],
) -> None:
    """Refuse an unmask unless its live and dropped lists split this node's neighbourhood,
    this node live, with at least ``threshold`` neighbours live, and every forwarded share
    comes from a live neighbour. What passes reveals the shares of ``sources`` (live) and
    the pair seeds with ``dropped``: never both for one node."""
    if set(active) & set(dropped):
        raise SecAggProtocolError("unmask message lists a node as both live and dropped; refusing")
    if node_id not in active:
        raise SecAggProtocolError("unmask message lists this node as not live; refusing")
    if len(active) + len(dropped) != len(set(active) | set(dropped)) or (
        set(active) | set(dropped)
    ) != set(neighbours) | {node_id}:
        raise SecAggProtocolError(
            "unmask message does not split this node's neighbourhood into live and dropped "
            "nodes (rule: every neighbour exactly once); refusing"
        )
    live = len(set(active) - {node_id})
    if live < threshold:
        raise SecAggProtocolError(
            f"only {live} live neighbours, below the threshold {threshold} (rule: unmask only "
            "with at least threshold live neighbours, so no server holds both secrets of a "
            "node); refusing"
        )
    if set(sources) - set(active) or node_id in sources:
        raise SecAggProtocolError(
            "unmask message forwards shares that do not match live neighbours"
        )


def check_numbers(rec: ConfigRecord) -> tuple[int, float, int, int]:
    """Threshold, clipping range, quantization levels and modulus, each finite and in range."""
    t = wire.get_number(rec, wire.KEY_THRESHOLD)
    clip = wire.get_number(rec, wire.KEY_CLIPPING_RANGE)
    levels = wire.get_number(rec, wire.KEY_QUANTIZATION_RANGE)
    m = wire.get_number(rec, wire.KEY_MODULUS_RANGE)
    scales = wire.get_float_list(rec, wire.KEY_SCALE_VALUES)
    ok = (
        math.isfinite(t)
        and t == int(t)
        and t >= 1
        and math.isfinite(clip)
        and clip > 0
        and m in {2.0**b for b in range(1, 33)}
        and math.isfinite(levels)
        and levels == int(levels)
        and 1 <= levels < m
        and all(math.isfinite(x) and x > 0 for x in scales)
    )
    if not ok:
        raise SecAggProtocolError(
            "collect message: threshold, clipping range, quantization range, modulus or a "
            "scale is not a finite number in its range (rule: every number from a message is "
            "finite and in range); refusing"
        )
    return int(t), clip, int(levels), int(m)


def check_identities(
    state: ConfigRecord,
    session: str,
    adverts: list[tuple[int, bytes, bytes, bytes, bytes]],
    rules: ClientRules,
    store: PinStore | None = None,
) -> None:
    """Verify each (node, pk1, pk2, identity, signature) advertisement: the identity against
    the trust list and the one pinned for that node id, then the signature; pin new
    identities (a pin is never replaced) in ``store`` on the node's disk, which outlives
    the run, or in ``state`` when there is no store (an engine without a node: tests)."""
    pins = store.load() if store is not None else identity_pins(state)
    before = dict(pins)
    for u, pk1, pk2, key, sig in adverts:
        if rules.trusted is not None and key not in rules.trusted:
            raise SecAggProtocolError(
                f"node {u}'s identity key is not in this node's trust list (rule: neighbours "
                "only under operator-distributed keys); refusing"
            )
        if pins.setdefault(u, key) != key:
            raise SecAggProtocolError(
                f"node {u} advertises a different identity key than the one pinned for it "
                "(rule: an identity pin is never replaced); refusing"
            )
        if not ident.verify_advert(key, sig, session, u, pk1, pk2):
            raise SecAggProtocolError(
                f"node {u}'s public keys do not carry a valid signature of its identity "
                "(rule: key advertisements are signed); refusing"
            )
    if store is not None:
        if pins != before:
            store.save(pins)
        return
    order = sorted(pins)
    state[PIN_FIELDS[0]] = wire.pack_ids(order)
    state[PIN_FIELDS[1]] = [pins[u] for u in order]


def identity_pins(state: ConfigRecord) -> dict[int, bytes]:
    """Node id -> identity key, as first seen; kept across key sessions."""
    if PIN_FIELDS[0] not in state:
        return {}
    ids = wire.unpack_ids(wire.get_bytes(state, PIN_FIELDS[0]))
    return dict(zip(ids, wire.get_bytes_list(state, PIN_FIELDS[1]), strict=True))
