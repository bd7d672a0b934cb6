"""An active malicious SecAgg+ server as a script: it crafts stage messages and tries to unmask one input.

The clients are fedge's real :class:`fedge.clients.secagg.engine.SecAggClientEngine` objects
(or real ClientApps behind a Flower grid); only the server is played. ``recover`` is
what such a server computes from the replies it collected: the victim's masked input
minus its self mask minus every pair mask it learnt. It returns the victim's input only
when the clients handed over both kinds of secret. :func:`drive` runs such a script as a
ServerApp over a Flower grid, and :func:`strictest_round` runs one distributed-DP round of
fedge's own aggregators there, under :data:`STRICTEST`, through the grid a server hands it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.clients.privacy.policy import POLICY_ENV
from fedge.clients.secagg.engine import ClientRules, SecAggClientEngine
from fedge.secagg import identity, wire
from fedge.secagg.binding import contribution_digest
from fedge.secagg.config import SecAggConfig
from fedge.secagg.crypto import combine_secret, derive, mask_info
from fedge.secagg.identity import SIGNATURE_BYTES
from fedge.secagg.vectors import Layout, dequantize_sum, prg_mask
from fedge.server.aggregation import AggregateResult
from fedge.server.privacy.aggregators import DistributedDPAggregator
from fedge.server.privacy.config import DPConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess
from tests.secagg.harness import known_client_app

CFG = SecAggConfig()  # the defaults every attack uses for clipping, quantization and modulus
MASKED = "masked"
SPEC = {"delta/w": (64,), "meta/weight": (1,), "meta/count": (1,)}  # what contribution() sends
STRICTEST = """require-secagg = true
require-dp = true
min-noise = 1.0
max-clip = 0.1
max-epsilon = 50.0
secagg-min-neighbours = 4
secagg-min-threshold = 3
trusted-keys = "trust.txt"
once-per-model = true
"""


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


def contribution(pid: int) -> dict[str, np.ndarray]:
    """Partition ``pid``'s private contribution (:data:`SPEC`), as its ClientApp sends it."""
    return {
        **secret_input(pid, 64),
        "meta/weight": np.ones(1, np.float32),
        "meta/count": np.ones(1, np.float32),
    }


def drive(grid: InProcessGrid, script: Callable[[Grid], dict[str, Any]]) -> dict[str, Any]:
    """Run ``script`` as the ServerApp's main on ``grid``; return what it stashed."""
    out: dict[str, Any] = {}
    app = ServerApp()

    @app.main()
    def main(g: Grid, context: Context) -> None:
        out.update(script(g))

    run_inprocess(app, grid)
    return out


def strictest_round(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: Mapping[str, str] | None = None,
    through: Callable[[Grid], Grid] | None = None,
) -> AggregateResult:
    """One round of fedge's SecAgg+ with distributed DP over Flower messages: five nodes
    running :func:`contribution` behind fedge's ClientApp stack, each under :data:`STRICTEST`
    with its identity key on disk and a trust list naming them all.

    The train config is ``weighting = uniform`` plus ``config``; ``through`` wraps the grid the
    server's aggregator sends on (a malicious server's tampering; None: honest). z = 1.2 for 4
    of 5: each client verifies 1 + 2*3 - 4 = 3 contributors and 1.2 sqrt(3/4) >= min-noise 1.
    """
    state = tmp_path / "node-state"
    keys_ = [
        identity.load_or_create(state / "secagg-identity" / f"partition-{pid:05d}.key")
        for pid in range(5)
    ]
    (tmp_path / "trust.txt").write_text(
        identity.format_trust_list(map(identity.public_bytes, keys_))
    )
    (tmp_path / "policy.toml").write_text(STRICTEST)
    monkeypatch.setenv(POLICY_ENV, str(tmp_path / "policy.toml"))
    monkeypatch.setenv(STATE_DIR_ENV, str(state))
    app = known_client_app(contribution, lambda pid: 1.0 + pid)
    grid = InProcessGrid(app, DeviceTable(5, seed=9), tmp_path / "context")
    dp = DPConfig(mode="distributed", clip_norm=0.05, noise_multiplier=1.2, min_survival=0.8)
    aggregator = DistributedDPAggregator(
        SecAggPlusAggregator(SecAggConfig(num_shares=1.0, stage_timeout_s=60)), dp
    )
    content = RecordDict(
        {
            keys.REC_CONFIG: ConfigRecord({"weighting": "uniform", **(config or {})}),
            keys.REC_GLOBAL: ArrayRecord({"w": Array(np.zeros(4, np.float32))}),
        }
    )

    def script(g: Grid) -> dict[str, Any]:
        sent = through(g) if through is not None else g
        nodes = sorted(g.get_node_ids())
        return {"result": aggregator.aggregate(sent, 1, nodes, content, SPEC, 60)}

    result: AggregateResult = drive(grid, script)["result"]
    return result
