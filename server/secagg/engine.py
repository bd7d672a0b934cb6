"""Server half of SecAgg+ as a transport-free state machine: stage requests in, replies out.

Keys are advertised once per key session (:class:`KeyBook`, one per run); a round is
then two exchanges, collect and unmask (three when some sampled node has no keys yet).
Unmask asks only as many contributors as the thresholds need, plus a spare share per
node; the others are asked in a further exchange only if some of those stay silent.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedge.errors import FedgeError
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from fedge.secagg.crypto import check_public_key, combine_secret
from fedge.secagg.identity import SIGNATURE_BYTES, verify_advert, verify_share
from fedge.secagg.vectors import IntVec, Layout, dequantize_sum, prg_mask

log = logging.getLogger(__name__)

# Shares asked for beyond each node's threshold in the first unmask exchange, so one
# silent holder per neighbourhood costs no second exchange.
UNMASK_SPARE = 1


class SecAggRoundFailed(FedgeError):
    """A SecAgg+ round could not produce the sum; nothing from it may be applied."""


def ring_order(node_ids: Sequence[int], seed: int) -> list[int]:
    """The nodes' places on the ring: a shuffle seeded by ``seed``."""
    order = list(node_ids)
    np.random.default_rng(seed).shuffle(order)
    return order


def ring_neighbours(node_ids: Sequence[int], num_shares: int, seed: int) -> dict[int, list[int]]:
    """Place nodes on a shuffled ring; each node's neighbours are the nearest ``num_shares - 1``.

    This is the Harary-graph construction of SecAgg+: every node has the same degree and the
    server learns nothing from the placement beyond what it chose.
    """
    order = ring_order(node_ids, seed)
    n = len(order)
    half = math.ceil((num_shares - 1) / 2)
    out: dict[int, list[int]] = {}
    for pos, node in enumerate(order):
        near = {order[(pos + d) % n] for d in range(-half, half + 1) if d} - {node}
        out[node] = sorted(near)
    return out


class KeyBook:
    """The public keys of one key session: advertised once, reused every round of the run.

    ``ring_seed`` places the nodes on the ring for the whole session, so the same sampled
    nodes keep the same neighbours and clients reuse the X25519 secrets they computed.
    """

    def __init__(self) -> None:
        self.session = secrets.token_hex(8)
        self.ring_seed = secrets.randbits(63)
        self.keys: dict[int, tuple[bytes, bytes]] = {}
        self.signed: dict[int, tuple[bytes, bytes]] = {}  # node -> (identity, signature), relayed

    def missing(self, nodes: Sequence[int]) -> list[int]:
        """Nodes that have not advertised keys in this session."""
        return [u for u in nodes if u not in self.keys]

    def forget(self, nodes: Sequence[int]) -> None:
        """Drop keys (a node that lost them re-advertises next round)."""
        for u in nodes:
            self.keys.pop(u, None)
            self.signed.pop(u, None)

    def receive(self, replies: Mapping[int, ConfigRecord]) -> None:
        """Keep well-formed, unique, signed public keys (a repeated key or identity would let
        one node pose as two; clients check the same and refuse, this only drops early)."""
        seen = {pk for pair in self.keys.values() for pk in pair}
        identities = {key for key, _ in self.signed.values()}
        for u, rec in replies.items():
            try:
                pk1, pk2 = wire.get_bytes(rec, wire.KEY_PK1), wire.get_bytes(rec, wire.KEY_PK2)
                key = wire.get_bytes(rec, wire.KEY_IDENTITY)
                sig = wire.get_bytes(rec, wire.KEY_SIGNATURE)
                check_public_key(pk1)
                check_public_key(pk2)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("SecAgg+: node %d sent unusable public keys (%s); dropped", u, exc)
                continue
            if pk1 in seen or pk2 in seen or pk1 == pk2 or key in identities:
                log.warning("SecAgg+: node %d repeats a public key or identity; dropped", u)
                continue
            if not verify_advert(key, sig, self.session, u, pk1, pk2):
                log.warning("SecAgg+: node %d's keys carry no valid signature; dropped", u)
                continue
            seen |= {pk1, pk2}
            identities.add(key)
            self.keys[u] = (pk1, pk2)
            self.signed[u] = (key, sig)


@dataclass
class _Round:
    """What the server knows about one round; never an individual unmasked vector."""

    neighbours: dict[int, list[int]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # ring order of the keyed nodes
    thresholds: dict[int, int] = field(default_factory=dict)
    forward: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    masked: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    layout: Layout | None = None
    extras: dict[int, RecordDict] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)  # contributors sent an unmask request
    shares: dict[int, list[tuple[int, bytes]]] = field(
        default_factory=dict
    )  # owner -> (holder, signed share)
    seeds: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (dropped, live) -> seed


class SecAggServerEngine:
    """Run one SecAgg+ sum over ``node_ids``: (advertise,) collect, unmask, then the sum.

    The caller delivers each stage's requests (``*_requests``) to the named nodes and hands
    the replies that arrived in time to the matching ``receive_*``; a node that does not
    answer has dropped out. Clients run ``fedge.clients.secagg.mod.secaggplus_mod``.
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
        keys: KeyBook | None = None,
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
        self.keys = keys if keys is not None else KeyBook()
        self._seed = seed if seed is not None else self.keys.ring_seed
        self._r = _Round()
        self.blamed: set[int] = set()  # nodes shown to have sent bad shares this round

    # ------------------------------------------------------------------ stage 0: keys (once)
    def advertise_requests(self) -> dict[int, RecordDict]:
        """Ask the sampled nodes without keys in this session to advertise two public keys."""
        return {
            u: RecordDict({wire.SECAGG_RECORD: self._record(wire.STAGE_ADVERTISE)})
            for u in self.keys.missing(self.nodes)
        }

    def receive_public_keys(self, replies: Mapping[int, RecordDict]) -> None:
        """Keep the nodes that advertised well-formed public keys."""
        recs = {
            u: r
            for u, c in replies.items()
            if (r := self._reply_record(u, c, wire.STAGE_ADVERTISE)) is not None
        }
        self.keys.receive(recs)
        unprotected = sorted(u for u, r in recs.items() if r.get(wire.KEY_NOTICE))
        if unprotected:  # once per key session: advertise runs once per node and session
            log.warning(
                "SecAgg+: %d node(s) hold no trust list (e.g. node %d): %s",
                len(unprotected),
                unprotected[0],
                wire.NOTICE_NO_TRUST_LIST,
            )

    # ------------------------------------------------------------------ stage 1: collect
    def collect_requests(self) -> dict[int, RecordDict]:
        """Send each keyed node its settings and neighbours' keys; it trains and masks."""
        keyed = [u for u in self.nodes if u in self.keys.keys]
        self._require(len(keyed), "hold SecAgg+ keys")
        num_shares = self.cfg.shares_for(len(keyed))
        self._r.neighbours = ring_neighbours(keyed, num_shares, self._seed)
        self._r.order = ring_order(keyed, self._seed)
        scale_names = [k for k, _ in self._scales()]
        scale_values = [float(v) for _, v in self._scales()]
        for u in keyed:
            try:
                self._r.thresholds[u] = self.cfg.threshold_for(len(self._r.neighbours[u]))
            except ValueError as exc:
                raise SecAggRoundFailed(f"SecAgg+: {exc}; no aggregate is applied") from exc
        graph = wire.pack_graph({u: (self._r.thresholds[u], self._r.neighbours[u]) for u in keyed})
        out = {}
        for u in keyed:
            hood = self._r.neighbours[u]
            rec = self._record(wire.STAGE_COLLECT)
            rec[wire.KEY_GRAPH] = graph
            rec[wire.KEY_THRESHOLD] = self._r.thresholds[u]
            rec[wire.KEY_NEIGHBOURS] = wire.pack_ids(hood)
            rec[wire.KEY_PEER_PK1] = [self.keys.keys[v][0] for v in hood]
            rec[wire.KEY_PEER_PK2] = [self.keys.keys[v][1] for v in hood]
            rec[wire.KEY_PEER_IDENTITY] = [self.keys.signed[v][0] for v in hood]
            rec[wire.KEY_PEER_SIGNATURE] = [self.keys.signed[v][1] for v in hood]
            rec[wire.KEY_CLIPPING_RANGE] = float(self.cfg.clipping_range)
            rec[wire.KEY_QUANTIZATION_RANGE] = int(self.cfg.quantization_range)
            rec[wire.KEY_MODULUS_RANGE] = int(self.cfg.modulus_range)
            rec[wire.KEY_SCALE_NAMES] = scale_names
            rec[wire.KEY_SCALE_VALUES] = scale_values
            rec[wire.KEY_MASKED_RECORD] = self.masked_record
            rec[wire.KEY_OMIT_ZERO] = list(self.omit_zero)
            out[u] = RecordDict({wire.SECAGG_RECORD: rec})
        return out

    def receive_masked_inputs(self, replies: Mapping[int, RecordDict]) -> None:
        """Keep masked inputs whose layout agrees, and queue their encrypted seed shares."""
        for v in sorted(replies):
            content = replies[v]
            rec = self._reply_record(v, content, wire.STAGE_COLLECT)
            if rec is None or v not in self._r.neighbours:
                continue
            masked = content.get(self.masked_record)
            if not isinstance(masked, ArrayRecord):
                log.warning("SecAgg+: node %d sent no %r record; dropped", v, self.masked_record)
                continue
            try:
                dsts = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_DESTINATIONS))
                cts = wire.get_bytes_list(rec, wire.KEY_CIPHERTEXTS)
            except ValueError as exc:
                log.warning("SecAgg+: node %d sent malformed shares (%s); dropped", v, exc)
                continue
            if len(dsts) != len(cts) or sorted(dsts) != self._r.neighbours[v]:
                log.warning(
                    "SecAgg+: node %d did not share its seed with its neighbours; dropped", v
                )
                continue
            arrays = {k: a.numpy() for k, a in masked.items()}
            if not self._expected_layout(v, arrays):
                continue
            layout = Layout.of(arrays, dict(self._scales()))
            if self._r.layout is None:
                self._r.layout = layout
            elif layout != self._r.layout:
                log.warning("SecAgg+: node %d masked input layout differs; dropped", v)
                continue
            self._r.masked[v] = arrays
            for u, ct in zip(dsts, cts, strict=True):
                self._r.forward.setdefault(u, []).append((v, ct))
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
        """Records each contributor sent beside its masked input (none from fedge's mod)."""
        return dict(self._r.extras)

    # ------------------------------------------------------------------ stage 2: unmask
    def unmask_requests(self) -> dict[int, RecordDict]:
        """Ask contributors for live neighbours' seed shares and dropped ones' pair seeds.

        The first call asks the holders :meth:`_first_holders` picks; a later call (after
        :meth:`receive_unmask_shares` returned None) asks every contributor not asked yet.
        Every request names the same live and dropped sets.
        """
        alive = set(self._r.masked)
        if not self._r.asked:
            for v in sorted(alive):
                active = set(self._r.neighbours[v]) & alive
                if len(active) < self._r.thresholds[v]:
                    raise SecAggRoundFailed(
                        f"SecAgg+: only {len(active)} live neighbours of node {v}, below its "
                        f"threshold {self._r.thresholds[v]}; the round is abandoned and no "
                        "aggregate is applied"
                    )
            targets = self._first_holders(alive)
        else:
            targets = alive - self._r.asked
        self._r.asked |= targets
        out = {}
        for v in sorted(targets):
            hood = set(self._r.neighbours[v])
            fwd = [(u, ct) for u, ct in self._r.forward.get(v, []) if u in alive and u != v]
            rec = self._record(wire.STAGE_UNMASK)
            rec[wire.KEY_ACTIVE] = wire.pack_ids(sorted((hood | {v}) & alive))
            rec[wire.KEY_DROPPED] = wire.pack_ids(sorted(hood - alive))
            rec[wire.KEY_SOURCES] = wire.pack_ids([u for u, _ in fwd])
            rec[wire.KEY_CIPHERTEXTS] = [ct for _, ct in fwd]
            out[v] = RecordDict({wire.SECAGG_RECORD: rec})
        return out

    def receive_unmask_shares(
        self, replies: Mapping[int, RecordDict]
    ) -> dict[str, np.ndarray] | None:
        """Keep the shares and seeds; return the float sum once the masks can be removed.

        Returns None when more shares are needed and some contributor has not been asked
        yet (ask again with :meth:`unmask_requests`); raises `SecAggRoundFailed` when every
        contributor was asked and the shares still fall short.
        """
        alive = set(self._r.masked)
        for v, content in replies.items():
            rec = self._reply_record(v, content, wire.STAGE_UNMASK)
            if rec is None or v not in self._r.asked:
                continue
            try:
                owners = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SHARE_OWNERS))
                shares = wire.get_bytes_list(rec, wire.KEY_SHARES)
                seed_peers = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SEED_PEERS))
                pair_seeds = wire.get_bytes_list(rec, wire.KEY_SEEDS)
            except ValueError as exc:
                log.warning("SecAgg+: node %d sent malformed shares (%s); ignored", v, exc)
                continue
            if len(owners) != len(shares) or len(seed_peers) != len(pair_seeds):
                log.warning("SecAgg+: node %d sent mismatched unmask lists; ignored", v)
                continue
            hood = set(self._r.neighbours[v])
            for u, share in zip(owners, shares, strict=True):
                if u in alive and u in hood:  # a node holds no share of its own seed
                    self._r.shares.setdefault(u, []).append((v, share))
            for u, seed in zip(seed_peers, pair_seeds, strict=True):
                if u in hood and u not in alive:
                    self._r.seeds[(u, v)] = seed
        short = sorted(u for u in alive if len(self._r.shares.get(u, [])) < self._r.thresholds[u])
        missing = sorted(
            (u, v)
            for u in self._r.neighbours
            if u not in alive
            for v in self._r.neighbours[u]
            if v in alive and (u, v) not in self._r.seeds
        )
        if not short and not missing:
            return self._unmask(alive, self._r.shares, self._r.seeds)
        if alive - self._r.asked:
            return None
        detail = ", ".join(
            f"{u}: {len(self._r.shares.get(u, []))}/{self._r.thresholds[u]}" for u in short
        )
        raise SecAggRoundFailed(
            f"SecAgg+ unmask: too few shares or seeds to remove the masks (self-mask shares "
            f"{detail or 'complete'}; {len(missing)} pairwise seed(s) of dropped nodes missing); "
            "more clients dropped out than the protocol tolerates. The round is abandoned and "
            "no aggregate is applied."
        )

    def _first_holders(self, alive: set[int]) -> set[int]:
        """The contributors the first unmask exchange asks: fewer messages, the same secrecy.

        Every live neighbour of a drop-out is asked (only it knows that pair's seed). Of the
        rest, going round the ring, a node is left out while each contributor whose share it
        holds keeps ``threshold + UNMASK_SPARE`` asked holders (or all it has). Asking fewer
        clients reveals less, never more: each asked client applies its own checks.
        """
        holders = {v: set(self._r.neighbours[v]) & alive for v in alive}
        need = {v: min(self._r.thresholds[v] + UNMASK_SPARE, len(holders[v])) for v in alive}
        count = {v: len(holders[v]) for v in alive}
        left_out: set[int] = set()
        for w in self._r.order:
            if w not in alive or set(self._r.neighbours[w]) - alive:
                continue
            if all(count[v] > need[v] for v in holders[w]):  # w holds shares of holders[w]
                for v in holders[w]:
                    count[v] -= 1
                left_out.add(w)
        return alive - left_out

    # ------------------------------------------------------------------ helpers
    def _unmask(
        self,
        alive: set[int],
        collected: Mapping[int, list[tuple[int, bytes]]],
        seeds: Mapping[tuple[int, int], bytes],
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
            seed = self._self_seed(v, collected[v])
            total -= prg_mask(seed, layout.size, m)
        for (u, v), seed in sorted(seeds.items()):
            mask = prg_mask(seed, layout.size, m)
            # live node v added +mask when v < u and -mask otherwise; undo it
            if v < u:
                total -= mask
            else:
                total += mask
        total &= np.uint32(m - 1)
        flat_sum = dequantize_sum(
            total, len(alive), self.cfg.clipping_range, self.cfg.quantization_range
        )
        return layout.unflatten(flat_sum)

    def _self_seed(self, owner: int, held: list[tuple[int, bytes]]) -> bytes:
        """Rebuild ``owner``'s self-mask seed from (holder, signed share) pairs.

        Signatures are checked only when the first ``threshold`` shares fail to combine:
        a share whose owner's signature fails was altered by its holder (blamed, dropped);
        validly signed shares that still fail were dealt wrong by the owner (blamed).
        """
        t = self._r.thresholds[owner]
        try:
            return combine_secret([signed[:-SIGNATURE_BYTES] for _, signed in held[:t]])
        except ValueError:
            pass
        identity = self.keys.signed[owner][0]
        good = []
        for holder, signed in held:
            share = verify_share(identity, signed, self.keys.session, self.round_id, owner, holder)
            if share is None:
                self.blamed.add(holder)
                log.warning(
                    "SecAgg+: node %d revealed a share of node %d it altered", holder, owner
                )
            else:
                good.append(share)
        if len(good) < t:
            raise SecAggRoundFailed(
                f"SecAgg+ unmask: too few unaltered shares of node {owner}'s self-mask seed; "
                f"altered by node(s) {sorted(self.blamed)}, blamed; no aggregate is applied"
            )
        try:
            return combine_secret(good[:t])
        except ValueError:
            self.blamed.add(owner)
            raise SecAggRoundFailed(
                f"SecAgg+ unmask: node {owner} dealt shares of its self-mask seed that do not "
                "combine (each signed by it): node blamed; no aggregate is applied"
            ) from None

    def _scales(self) -> tuple[tuple[str, float], ...]:
        """Per-key divisors: the configured ones, plus the metrics'."""
        return (*self.cfg.key_scales, *wire.METRIC_SCALES)

    def _expected_layout(self, v: int, arrays: Mapping[str, np.ndarray]) -> bool:
        """Whether a masked input has the expected keys and shapes (metrics: shape (1,))."""
        if self.expected is None:
            return True
        model = {
            k: tuple(a.shape) for k, a in arrays.items() if not k.startswith(wire.PREFIX_METRIC)
        }
        metrics_ok = all(
            tuple(a.shape) == (1,) for k, a in arrays.items() if k.startswith(wire.PREFIX_METRIC)
        )
        if model != {k: tuple(s) for k, s in self.expected.items()} or not metrics_ok:
            log.warning("SecAgg+: node %d masked input has the wrong keys or shapes; dropped", v)
            return False
        return True

    def _record(self, stage: str) -> ConfigRecord:
        rec = ConfigRecord({wire.KEY_STAGE: stage, wire.KEY_SESSION: self.keys.session})
        if stage != wire.STAGE_ADVERTISE:
            rec[wire.KEY_ROUND] = self.round_id
        return rec

    def _reply_record(self, node: int, content: RecordDict, stage: str) -> ConfigRecord | None:
        """Return the protocol record of a reply, or None (logged) when it is malformed."""
        rec = content.config_records.get(wire.SECAGG_RECORD)
        ok = (
            rec is not None
            and rec.get(wire.KEY_STAGE) == stage
            and rec.get(wire.KEY_SESSION) == self.keys.session
            and (stage == wire.STAGE_ADVERTISE or rec.get(wire.KEY_ROUND) == self.round_id)
        )
        if not ok:
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
