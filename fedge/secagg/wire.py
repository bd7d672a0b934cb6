"""Wire names of the SecAgg+ protocol, shared by the server engine and the client mod."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# Name of the ConfigRecord that carries the protocol fields in every stage message.
SECAGG_RECORD = "fedge.secagg"
# Name of the ConfigRecord in the client's context state that holds its protocol state.
SECAGG_STATE_RECORD = "fedge.secagg.state"

# Stage names, in protocol order. Keys are advertised once per session (run); every
# round is then two exchanges: collect (train + masked input + encrypted self-mask
# shares) and unmask.
STAGE_ADVERTISE = "advertise-keys"
STAGE_COLLECT = "collect-masked-input"
STAGE_UNMASK = "unmask"
STAGES = (STAGE_ADVERTISE, STAGE_COLLECT, STAGE_UNMASK)

# Fields inside SECAGG_RECORD.
KEY_STAGE = "stage"
KEY_SESSION = "session"  # str: the server's key session; keys are agreed once per session
KEY_ROUND = "round-id"  # str: fresh per round; a client never accepts one twice
KEY_THRESHOLD = "threshold"
KEY_NEIGHBOURS = "neighbours"  # packed uint64 node ids, parallel to KEY_PEER_PK1/KEY_PEER_PK2
# The round's whole graph, the same in every client's collect message (pack_graph): each
# node's threshold and neighbours. It is in the contribution digest (fedge.secagg.binding),
# so a client told a different neighbourhood than its neighbours were told masks in vain.
KEY_GRAPH = "graph"
KEY_PEER_PK1 = "peer-pk1"
KEY_PEER_PK2 = "peer-pk2"
KEY_CLIPPING_RANGE = "clipping-range"
KEY_QUANTIZATION_RANGE = "quantization-range"
KEY_MODULUS_RANGE = "modulus-range"
KEY_SCALE_NAMES = "scale-names"
KEY_SCALE_VALUES = "scale-values"
KEY_MASKED_RECORD = "masked-record"
KEY_OMIT_ZERO = "omit-zero"  # list[str]: contribution keys that must be zero and are not sent
KEY_PK1 = "pk1"  # public key for pairwise mask agreement
KEY_PK2 = "pk2"  # public key for share encryption
KEY_IDENTITY = "identity"  # the node's long-term Ed25519 public key (fedge.secagg.identity)
KEY_SIGNATURE = "signature"  # its signature over the session, node id, pk1 and pk2
KEY_PEER_IDENTITY = "peer-identity"  # parallel to KEY_NEIGHBOURS: relayed identities
KEY_PEER_SIGNATURE = "peer-signature"  # parallel to KEY_NEIGHBOURS: relayed signatures
KEY_DESTINATIONS = "destinations"  # packed uint64 node ids, parallel to KEY_CIPHERTEXTS
KEY_SOURCES = "sources"  # packed uint64 node ids, parallel to KEY_CIPHERTEXTS
KEY_CIPHERTEXTS = "ciphertexts"
KEY_ACTIVE = "active"  # packed uint64 node ids whose self-mask shares are asked for
KEY_DROPPED = "dropped"  # packed uint64 node ids whose round pair seeds are asked for
KEY_SHARE_OWNERS = "share-owners"  # packed uint64 node ids, parallel to KEY_SHARES
KEY_SHARES = "shares"  # each a Shamir share followed by its owner's Ed25519 signature
KEY_SEED_PEERS = "seed-peers"  # packed uint64 node ids, parallel to KEY_SEEDS
KEY_SEEDS = "pair-seeds"  # this round's pairwise mask seeds with dropped neighbours
KEY_NOTICE = "notice"  # str in a client's reply: a promise it cannot make (NOTICE_*)
NOTICE_NO_TRUST_LIST = (
    "no-trust-list: this node trusts neighbours' identities on first use, so it makes no "
    "promise against an active server that invents neighbours; give it a trust list "
    "(trusted-keys in its privacy policy, or secagg-trusted-keys)"
)

# Per-client metrics travel summed inside the masked vector, never in clear.
PREFIX_METRIC = "metric/"
METRIC_SCALES = (("metric/", 100.0), ("metric/num-examples", 1e5))  # divisors before quantizing


def pack_ids(node_ids: Sequence[int]) -> bytes:
    """Pack node ids as little-endian uint64 bytes: Flower node ids may exceed int64."""
    return np.asarray(list(node_ids), dtype=np.uint64).astype("<u8").tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    """Unpack node ids written by `pack_ids`."""
    if len(blob) % 8:
        raise ValueError(f"packed node id field has {len(blob)} bytes, not a multiple of 8")
    return [int(x) for x in np.frombuffer(blob, dtype="<u8")]


def pack_graph(graph: Mapping[int, tuple[int, Sequence[int]]]) -> bytes:
    """Pack ``{node: (threshold, neighbours)}`` canonically: sorted nodes, sorted neighbours."""
    flat: list[int] = []
    for node in sorted(graph):
        threshold, hood = graph[node]
        flat += [node, threshold, len(hood), *sorted(hood)]
    return pack_ids(flat)


def unpack_graph(blob: bytes) -> dict[int, tuple[int, list[int]]]:
    """Unpack what :func:`pack_graph` wrote; a malformed or non-canonical graph is an error."""
    flat = unpack_ids(blob)
    out: dict[int, tuple[int, list[int]]] = {}
    i = 0
    while i < len(flat):
        if i + 3 > len(flat) or i + 3 + flat[i + 2] > len(flat):
            raise WireError("SecAgg+ field 'graph' is truncated")
        node, threshold, k = flat[i : i + 3]
        hood = flat[i + 3 : i + 3 + k]
        if node in out or hood != sorted(set(hood)):
            raise WireError("SecAgg+ field 'graph' repeats a node or is not in canonical order")
        out[node] = (threshold, hood)
        i += 3 + k
    if pack_graph(out) != blob:
        raise WireError("SecAgg+ field 'graph' is not in canonical order")
    return out


class WireError(ValueError):
    """A SecAgg+ record field is missing or has the wrong type."""


def get_bytes(rec: Mapping[str, object], key: str) -> bytes:
    """Return field `key` of a protocol record as bytes, or raise naming the field."""
    value = rec.get(key)
    if not isinstance(value, bytes):
        raise WireError(f"SecAgg+ field {key!r} is missing or not bytes")
    return value


def get_bytes_list(rec: Mapping[str, object], key: str) -> list[bytes]:
    """Return field `key` as a list of bytes (empty when absent), or raise naming the field."""
    value = rec.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, bytes) for x in value):
        raise WireError(f"SecAgg+ field {key!r} is not a list of bytes")
    return list(value)


def get_str_list(rec: Mapping[str, object], key: str) -> list[str]:
    """Return field `key` as a list of str (empty when absent), or raise naming the field."""
    value = rec.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise WireError(f"SecAgg+ field {key!r} is not a list of str")
    return list(value)


def get_float_list(rec: Mapping[str, object], key: str) -> list[float]:
    """Return field `key` as a list of float (empty when absent), or raise naming the field."""
    value = rec.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, int | float) for x in value):
        raise WireError(f"SecAgg+ field {key!r} is not a list of numbers")
    return [float(x) for x in value]


def get_number(rec: Mapping[str, object], key: str) -> float:
    """Return numeric field `key`, or raise naming the field."""
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(f"SecAgg+ field {key!r} is missing or not a number")
    return float(value)


def get_scales(rec: Mapping[str, object]) -> dict[str, float]:
    """Return the per-key divisors announced in the setup stage."""
    return dict(
        zip(get_str_list(rec, KEY_SCALE_NAMES), get_float_list(rec, KEY_SCALE_VALUES), strict=True)
    )
