"""An active malicious SecAgg+ server as a script: it crafts stage messages and tries to unmask one input.

The clients are fedge's real :class:`fedge.clients.secagg.engine.SecAggClientEngine` objects
(or real ClientApps behind a Flower grid); only the server is played. ``recover`` is
what such a server computes from the replies it collected: the victim's masked input
minus its self mask minus every pair mask it learnt. It returns the victim's input only
when the clients handed over both kinds of secret.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, RecordDict

from fedge.clients.secagg.engine import ClientRules, SecAggClientEngine
from fedge.secagg import identity, wire
from fedge.secagg.binding import contribution_digest
from fedge.secagg.config import SecAggConfig
from fedge.secagg.crypto import combine_secret, derive, mask_info
from fedge.secagg.identity import SIGNATURE_BYTES
from fedge.secagg.vectors import Layout, dequantize_sum, prg_mask

CFG = SecAggConfig()  # the defaults every attack uses for clipping, quantization and modulus
MASKED = "masked"


def secret_input(seed: int, size: int = 64) -> dict[str, np.ndarray]:
    """A victim's private contribution: random, so a recovery cannot be a coincidence."""
    rng = np.random.default_rng(seed)
    return {"delta/w": rng.normal(0, 0.5, size).astype(np.float32)}


def collect_record(
    neighbours: list[int],
    pk1s: list[bytes],
    pk2s: list[bytes],
    threshold: int,
    session: str,
    round_id: str,
    extra: Mapping[str, object] | None = None,
    node: int | None = None,
) -> RecordDict:
    """A collect-masked-input request as the server engine writes it, with the fields given.

    Its round graph is the star around ``node`` (each neighbour's threshold 1), or empty
    when ``node`` is None."""
    graph = {} if node is None else {node: (threshold, neighbours)}
    for u in neighbours if node is not None else []:
        graph[u] = (1, [node])
    rec = ConfigRecord(
        {
            wire.KEY_STAGE: wire.STAGE_COLLECT,
            wire.KEY_SESSION: session,
            wire.KEY_ROUND: round_id,
            wire.KEY_THRESHOLD: threshold,
            wire.KEY_NEIGHBOURS: wire.pack_ids(neighbours),
            wire.KEY_GRAPH: wire.pack_graph(graph),
            wire.KEY_PEER_PK1: pk1s,
            wire.KEY_PEER_PK2: pk2s,
            wire.KEY_PEER_IDENTITY: [],
            wire.KEY_PEER_SIGNATURE: [],
            wire.KEY_CLIPPING_RANGE: float(CFG.clipping_range),
            wire.KEY_QUANTIZATION_RANGE: int(CFG.quantization_range),
            wire.KEY_MODULUS_RANGE: int(CFG.modulus_range),
            wire.KEY_SCALE_NAMES: [],
            wire.KEY_SCALE_VALUES: [],
            wire.KEY_MASKED_RECORD: MASKED,
        }
    )
    for key, value in (extra or {}).items():
        rec[key] = value  # type: ignore[assignment]
    return RecordDict({wire.SECAGG_RECORD: rec})


def unmask_record(
    session: str,
    round_id: str,
    active: list[int],
    dropped: list[int],
    forwarded: list[tuple[int, bytes]],
) -> RecordDict:
    """An unmask request naming ``active`` and ``dropped`` and forwarding these shares."""
    rec = ConfigRecord(
        {
            wire.KEY_STAGE: wire.STAGE_UNMASK,
            wire.KEY_SESSION: session,
            wire.KEY_ROUND: round_id,
            wire.KEY_ACTIVE: wire.pack_ids(sorted(active)),
            wire.KEY_DROPPED: wire.pack_ids(sorted(dropped)),
            wire.KEY_SOURCES: wire.pack_ids([u for u, _ in forwarded]),
            wire.KEY_CIPHERTEXTS: [ct for _, ct in forwarded],
        }
    )
    return RecordDict({wire.SECAGG_RECORD: rec})


def advertise_record(session: str) -> RecordDict:
    """An advertise-keys request for ``session``."""
    rec = ConfigRecord({wire.KEY_STAGE: wire.STAGE_ADVERTISE, wire.KEY_SESSION: session})
    return RecordDict({wire.SECAGG_RECORD: rec})


def revealed(
    replies: list[tuple[int, RecordDict]],
) -> tuple[dict[int, list[bytes]], dict[frozenset[int], bytes]]:
    """Self-mask shares per owner, and pair seeds per unordered pair, in (sender, reply) pairs."""
    shares: dict[int, list[bytes]] = {}
    seeds: dict[frozenset[int], bytes] = {}
    for sender, reply in replies:
        rec = reply.config_records[wire.SECAGG_RECORD]
        owners = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SHARE_OWNERS))
        for owner, share in zip(owners, wire.get_bytes_list(rec, wire.KEY_SHARES), strict=True):
            shares.setdefault(owner, []).append(share)
        peers = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SEED_PEERS))
        for peer, seed in zip(peers, wire.get_bytes_list(rec, wire.KEY_SEEDS), strict=True):
            seeds[frozenset((sender, peer))] = seed  # both ends derive the same seed
    return shares, seeds


def recover(
    victim: int,
    masked: Mapping[str, np.ndarray],
    neighbours: list[int],
    self_shares: list[bytes],
    pair_seeds: Mapping[frozenset[int], bytes],
) -> dict[str, np.ndarray] | None:
    """The victim's input, if the shares rebuild its self-mask seed and every pair seed is known."""
    if any(frozenset((victim, u)) not in pair_seeds for u in neighbours):
        return None
    raw = [s[:-SIGNATURE_BYTES] if len(s) > 68 else s for s in self_shares]  # signed by owner
    try:
        seed = combine_secret(raw)
    except ValueError:
        return None
    layout = Layout.of(dict(masked), {})
    m = CFG.modulus_range
    total = layout.flatten({k: np.asarray(v, np.float64) for k, v in masked.items()})
    total = total.astype(np.uint64).astype(np.uint32)
    total -= prg_mask(seed, layout.size, m)
    for u in neighbours:
        mask = prg_mask(pair_seeds[frozenset((victim, u))], layout.size, m)
        if victim < u:  # the victim added the mask of a larger peer, subtracted a smaller one's
            total -= mask
        else:
            total += mask
    total &= np.uint32(m - 1)
    flat = dequantize_sum(total, 1, CFG.clipping_range, CFG.quantization_range)
    return layout.unflatten(flat)


def matches(recovered: Mapping[str, np.ndarray] | None, secret: Mapping[str, np.ndarray]) -> bool:
    """Whether a recovery equals the secret up to one quantization level."""
    if recovered is None:
        return False
    step = 2 * CFG.clipping_range / CFG.quantization_range
    return all(np.max(np.abs(recovered[k] - secret[k])) <= 2 * step for k in secret)


def forged_identity(node: int, session: str, pk1: bytes, pk2: bytes) -> dict[str, object]:
    """The best an attacker can attach to keys it made: its own identity's valid signature."""
    key = Ed25519PrivateKey.generate()
    return {
        wire.KEY_PEER_IDENTITY: [identity.public_bytes(key)],
        wire.KEY_PEER_SIGNATURE: [identity.sign_advert(key, session, node, pk1, pk2)],
    }


def pair_seed(secret: bytes, a: int, b: int, round_id: str, content: RecordDict) -> bytes:
    """The pair-mask seed of (a, b) this round: the server knows the content it sent."""
    return derive(secret, mask_info(a, b, round_id, contribution_digest(content).whole))


def engine(
    node: int, states: dict[int, ConfigRecord], rules: ClientRules | None = None
) -> SecAggClientEngine:
    """The real client engine of ``node`` on its persistent state."""
    return SecAggClientEngine(node, states.setdefault(node, ConfigRecord()), rules=rules)
