"""Server half of SecAgg+ as a transport-free state machine: stage requests in, replies out."""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from fedge.errors import FedgeError
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from fedge.secagg.crypto import MASK_PURPOSE, agree, check_public_key, combine_secret
from fedge.secagg.vectors import IntVec, Layout, dequantize_sum, prg_mask

log = logging.getLogger(__name__)


class SecAggRoundFailed(FedgeError):
    """A SecAgg+ round could not produce the sum; nothing from it may be applied."""


def ring_neighbours(node_ids: Sequence[int], num_shares: int, seed: int) -> dict[int, list[int]]:
    """Place nodes on a shuffled ring; each node's neighbours are the nearest `num_shares - 1`.

    This is the Harary-graph construction of SecAgg+: every node has the same degree and the
    server learns nothing from the placement beyond what it chose.
    """
    order = list(node_ids)
    np.random.default_rng(seed).shuffle(order)
    n = len(order)
    half = math.ceil((num_shares - 1) / 2)
    out: dict[int, list[int]] = {}
    for pos, node in enumerate(order):
        near = {order[(pos + d) % n] for d in range(-half, half + 1) if d} - {node}
        out[node] = sorted(near)
    return out


@dataclass
class _Round:
    """What the server knows about one round; never an individual unmasked vector."""

    neighbours: dict[int, list[int]]
    thresholds: dict[int, int]
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    forward: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    shared_keys: set[int] = field(default_factory=set)
    masked: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    layout: Layout | None = None
    extras: dict[int, RecordDict] = field(default_factory=dict)


class SecAggServerEngine:
    """Run one SecAgg+ sum over `node_ids`: four request/reply stages, then `result()`.

    The caller delivers each stage's requests (`*_requests`) to the named nodes and hands the
    replies that arrived in time to the matching `receive_*`; a node that does not answer has
    dropped out. Clients run `clients.secagg.mod.secaggplus_mod`.
    """

    def __init__(
        self,
        cfg: SecAggConfig,
        node_ids: Sequence[int],
        masked_record: str,
        expected: Mapping[str, tuple[int, ...]] | None = None,
        seed: int | None = None,
        min_contributors: int | None = None,
        omit_zero: Sequence[str] = (),
    ) -> None:
        nodes = sorted(set(node_ids))
        self.min_contributors = max(
            2, cfg.min_contributors if min_contributors is None else min_contributors
        )
        if len(nodes) < self.min_contributors:
            raise SecAggRoundFailed(
                f"SecAgg+ needs at least {self.min_contributors} sampled clients, got {len(nodes)}"
            )
        cfg.check_capacity(len(nodes))
        self.cfg = cfg
        self.masked_record = masked_record
        self.round_id = secrets.token_hex(8)
        self.omit_zero = sorted(omit_zero)
        self.expected = (
            {k: v for k, v in expected.items() if k not in self.omit_zero}
            if expected is not None
            else None
        )
        self.nodes = nodes
        num_shares = cfg.shares_for(len(nodes))
        neighbours = ring_neighbours(
            nodes, num_shares, seed if seed is not None else secrets.randbits(63)
        )
        self._r = _Round(
            neighbours=neighbours,
            thresholds={u: cfg.threshold_for(len(nb) + 1) for u, nb in neighbours.items()},
        )

    # ------------------------------------------------------------------ stage 1: setup
    def setup_requests(self) -> dict[int, RecordDict]:
        """Send each node the settings and its neighbour list; it answers with two public keys."""
        scale_names = [k for k, _ in self.cfg.key_scales]
        scale_values = [float(v) for _, v in self.cfg.key_scales]
        out = {}
        for u in self.nodes:
            rec = self._record(wire.STAGE_SETUP)
            rec[wire.KEY_THRESHOLD] = self._r.thresholds[u]
            rec[wire.KEY_NEIGHBOURS] = wire.pack_ids(self._r.neighbours[u])
            rec[wire.KEY_CLIPPING_RANGE] = float(self.cfg.clipping_range)
            rec[wire.KEY_QUANTIZATION_RANGE] = int(self.cfg.quantization_range)
            rec[wire.KEY_MODULUS_RANGE] = int(self.cfg.modulus_range)
            rec[wire.KEY_SCALE_NAMES] = scale_names
            rec[wire.KEY_SCALE_VALUES] = scale_values
            rec[wire.KEY_MASKED_RECORD] = self.masked_record
            rec[wire.KEY_OMIT_ZERO] = list(self.omit_zero)
            out[u] = RecordDict({wire.SECAGG_RECORD: rec})
        return out

    def receive_public_keys(self, replies: Mapping[int, RecordDict]) -> None:
        """Keep the nodes that advertised well-formed public keys."""
        for u, content in replies.items():
            rec = self._reply_record(u, content, wire.STAGE_SETUP)
            if rec is None:
                continue
            try:
                pk1, pk2 = wire.get_bytes(rec, wire.KEY_PK1), wire.get_bytes(rec, wire.KEY_PK2)
                check_public_key(pk1)
                check_public_key(pk2)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("SecAgg+: node %d sent unusable public keys (%s); dropped", u, exc)
                continue
            self._r.public_keys[u] = (pk1, pk2)
        self._require(len(self._r.public_keys), "advertised their keys")

    # ------------------------------------------------------------------ stage 2: share keys
    def share_keys_requests(self) -> dict[int, RecordDict]:
        """Send each keyed node its keyed neighbours' public keys; it answers with encrypted shares."""
        keyed = self._r.public_keys
        out = {}
        for u in sorted(keyed):
            peers = [v for v in [*self._r.neighbours[u], u] if v in keyed]
            peers.sort()
            rec = self._record(wire.STAGE_SHARE_KEYS)
            rec[wire.KEY_PEERS] = wire.pack_ids(peers)
            rec[wire.KEY_PEER_PK1] = [keyed[v][0] for v in peers]
            rec[wire.KEY_PEER_PK2] = [keyed[v][1] for v in peers]
            out[u] = RecordDict({wire.SECAGG_RECORD: rec})
        return out

    def receive_encrypted_shares(self, replies: Mapping[int, RecordDict]) -> None:
        """Queue every ciphertext for its destination; the server cannot read them."""
        for u, content in replies.items():
            rec = self._reply_record(u, content, wire.STAGE_SHARE_KEYS)
            if rec is None or u not in self._r.public_keys:
                continue
            try:
                dsts = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_DESTINATIONS))
                cts = wire.get_bytes_list(rec, wire.KEY_CIPHERTEXTS)
            except ValueError as exc:
                log.warning("SecAgg+: node %d sent malformed shares (%s); dropped", u, exc)
                continue
            if len(dsts) != len(cts) or set(dsts) - set(self._r.neighbours[u]):
                log.warning("SecAgg+: node %d sent shares for non-neighbours; dropped", u)
                continue
            self._r.shared_keys.add(u)
            for v, ct in zip(dsts, cts, strict=True):
                self._r.forward.setdefault(v, []).append((u, ct))
        self._require(len(self._r.shared_keys), "shared their keys")

    # ------------------------------------------------------------------ stage 3: masked input
    def collect_requests(self) -> dict[int, RecordDict]:
        """Forward each node the shares addressed to it; it trains and answers with a masked input."""
        out = {}
        for v in sorted(self._r.shared_keys):
            fwd = [(u, ct) for u, ct in self._r.forward.get(v, []) if u in self._r.shared_keys]
            rec = self._record(wire.STAGE_COLLECT)
            rec[wire.KEY_SOURCES] = wire.pack_ids([u for u, _ in fwd])
            rec[wire.KEY_CIPHERTEXTS] = [ct for _, ct in fwd]
            out[v] = RecordDict({wire.SECAGG_RECORD: rec})
        return out

    def receive_masked_inputs(self, replies: Mapping[int, RecordDict]) -> None:
        """Keep masked inputs whose names and shapes agree; other records of a reply pass through."""
        for v in sorted(replies):
            content = replies[v]
            rec = self._reply_record(v, content, wire.STAGE_COLLECT)
            if rec is None or v not in self._r.shared_keys:
                continue
            if self.masked_record not in content.array_records:
                log.warning("SecAgg+: node %d sent no %r record; dropped", v, self.masked_record)
                continue
            arrays = {k: a.numpy() for k, a in content.array_records[self.masked_record].items()}
            layout = Layout.of(arrays, dict(self.cfg.key_scales))
            if self.expected is not None and {k: tuple(a.shape) for k, a in arrays.items()} != {
                k: tuple(s) for k, s in self.expected.items()
            }:
                log.warning(
                    "SecAgg+: node %d masked input has the wrong keys or shapes; dropped", v
                )
                continue
            if self._r.layout is None:
                self._r.layout = layout
            elif layout != self._r.layout:
                log.warning("SecAgg+: node %d masked input layout differs; dropped", v)
                continue
            self._r.masked[v] = arrays
            rest = RecordDict()
            for name, record in content.items():
                if name not in (self.masked_record, wire.SECAGG_RECORD):
                    rest[name] = record
            self._r.extras[v] = rest
        self._require(len(self._r.masked), "sent their masked input")

    @property
    def contributors(self) -> list[int]:
        """Nodes whose masked input is in the sum."""
        return sorted(self._r.masked)

    @property
    def extras(self) -> dict[int, RecordDict]:
        """Records each contributor sent beside its masked input (metrics, plain configs)."""
        return dict(self._r.extras)

    # ------------------------------------------------------------------ stage 4: unmask
    def unmask_requests(self) -> dict[int, RecordDict]:
        """Ask each contributor for self-mask shares of contributors and key shares of drop-outs."""
        alive = set(self._r.masked)
        dropped = self._r.shared_keys - alive
        out = {}
        for v in sorted(alive):
            hood = set(self._r.neighbours[v])
            rec = self._record(wire.STAGE_UNMASK)
            rec[wire.KEY_ACTIVE] = wire.pack_ids(sorted((hood | {v}) & alive))
            rec[wire.KEY_DROPPED] = wire.pack_ids(sorted(hood & dropped))
            out[v] = RecordDict({wire.SECAGG_RECORD: rec})
        return out

    def receive_unmask_shares(self, replies: Mapping[int, RecordDict]) -> dict[str, np.ndarray]:
        """Rebuild the masks from the shares and return the float sum of the contributors' inputs."""
        alive = set(self._r.masked)
        dropped = self._r.shared_keys - alive
        collected: dict[int, list[bytes]] = {}
        for v, content in replies.items():
            rec = self._reply_record(v, content, wire.STAGE_UNMASK)
            if rec is None or v not in alive:
                continue
            try:
                owners = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SHARE_OWNERS))
                shares = wire.get_bytes_list(rec, wire.KEY_SHARES)
            except ValueError as exc:
                log.warning("SecAgg+: node %d sent malformed shares (%s); ignored", v, exc)
                continue
            if len(owners) != len(shares):
                log.warning(
                    "SecAgg+: node %d sent %d owners for %d shares; ignored",
                    v,
                    len(owners),
                    len(shares),
                )
                continue
            for u, share in zip(owners, shares, strict=True):
                if u in alive or (u in dropped and u in self._r.neighbours[v]):
                    collected.setdefault(u, []).append(share)
        needed = alive | {u for u in dropped if set(self._r.neighbours[u]) & alive}
        short = sorted(u for u in needed if len(collected.get(u, [])) < self._r.thresholds[u])
        if short:
            detail = ", ".join(
                f"{u}: {len(collected.get(u, []))}/{self._r.thresholds[u]}" for u in short
            )
            raise SecAggRoundFailed(
                f"SecAgg+ unmask: too few shares to rebuild the masks of {len(short)} node(s) "
                f"({detail}); more clients dropped out than the reconstruction threshold "
                "tolerates. The round is abandoned and no aggregate is applied."
            )
        return self._unmask(alive, dropped, collected)

    # ------------------------------------------------------------------ helpers
    def _unmask(
        self, alive: set[int], dropped: set[int], collected: Mapping[int, list[bytes]]
    ) -> dict[str, np.ndarray]:
        """Sum the masked inputs mod M, strip self masks and drop-outs' pairwise masks."""
        layout = self._r.layout
        assert layout is not None  # receive_masked_inputs required at least one input
        m = self.cfg.modulus_range
        # uint32 arithmetic wraps mod 2**32, a multiple of m: reduce mod m once at the end
        total: IntVec = np.zeros(layout.size, dtype=np.uint32)
        for v in sorted(alive):
            for name, chunk in layout.split(total).items():  # views into total
                chunk += np.asarray(self._r.masked[v][name], dtype=np.uint32).reshape(chunk.shape)
        for v in sorted(alive):
            seed = _combine(collected[v][: self._r.thresholds[v]], f"self-mask seed of node {v}")
            total -= prg_mask(seed, layout.size, m)
        for u in sorted(dropped):
            partners = sorted(set(self._r.neighbours[u]) & alive)
            if not partners:
                continue
            sk1 = _combine(collected[u][: self._r.thresholds[u]], f"mask key of node {u}")
            for v in partners:
                mask = prg_mask(agree(sk1, self._r.public_keys[v][0], MASK_PURPOSE), layout.size, m)
                # node v added +mask when v < u and -mask otherwise; undo it
                if v < u:
                    total -= mask
                else:
                    total += mask
        total &= np.uint32(m - 1)
        flat_sum = dequantize_sum(
            total, len(alive), self.cfg.clipping_range, self.cfg.quantization_range
        )
        return layout.unflatten(flat_sum)

    def _record(self, stage: str) -> ConfigRecord:
        return ConfigRecord({wire.KEY_STAGE: stage, wire.KEY_ROUND: self.round_id})

    def _reply_record(self, node: int, content: RecordDict, stage: str) -> ConfigRecord | None:
        """Return the protocol record of a reply, or None (logged) when it is malformed."""
        rec = content.config_records.get(wire.SECAGG_RECORD)
        if (
            rec is None
            or rec.get(wire.KEY_STAGE) != stage
            or rec.get(wire.KEY_ROUND) != self.round_id
        ):
            log.warning("SecAgg+: node %d sent no valid %s reply; dropped", node, stage)
            return None
        return rec

    def _require(self, count: int, what: str) -> None:
        need = self.min_contributors
        if count < need:
            raise SecAggRoundFailed(
                f"SecAgg+: only {count} client(s) {what}, need at least {need}; the round is "
                "abandoned and no aggregate is applied"
            )


def _combine(shares: list[bytes], what: str) -> bytes:
    try:
        return combine_secret(shares)
    except ValueError as exc:
        raise SecAggRoundFailed(f"SecAgg+ unmask: shares of the {what} do not combine") from exc
