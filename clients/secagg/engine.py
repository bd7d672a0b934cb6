"""Client half of SecAgg+ as a state machine whose state lives in a Flower ConfigRecord."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.fernet import InvalidToken
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from fedge.errors import FedgeError
from fedge.secagg import wire
from fedge.secagg.crypto import (
    MASK_PURPOSE,
    SHARE_PURPOSE,
    agree,
    fernet_key,
    generate_keypair,
    split_secret,
)
from fedge.secagg.vectors import Layout, prg_mask, quantize

Contribute = Callable[[], Mapping[str, np.ndarray]]

# Fields of the client's state record (wire.SECAGG_STATE_RECORD).
_S_ROUND = "round"
_S_STAGE = "stage"
_S_SK1 = "sk1"
_S_SK2 = "sk2"
_S_SEED = "self-seed"
_S_PEERS = "peers"
_S_PEER_PK1 = "peer-pk1"
_S_PEER_PK2 = "peer-pk2"
_S_OWNERS = "share-owners"
_S_SEED_SHARES = "seed-shares"
_S_SK_SHARES = "sk-shares"
_S_MASK_PEERS = "mask-peers"
_SETTINGS = (
    wire.KEY_THRESHOLD,
    wire.KEY_NEIGHBOURS,
    wire.KEY_CLIPPING_RANGE,
    wire.KEY_QUANTIZATION_RANGE,
    wire.KEY_MODULUS_RANGE,
    wire.KEY_SCALE_NAMES,
    wire.KEY_SCALE_VALUES,
    wire.KEY_MASKED_RECORD,
)
_PREVIOUS = {
    wire.STAGE_SHARE_KEYS: wire.STAGE_SETUP,
    wire.STAGE_COLLECT: wire.STAGE_SHARE_KEYS,
    wire.STAGE_UNMASK: wire.STAGE_COLLECT,
}


class SecAggProtocolError(FedgeError):
    """A SecAgg+ stage message was out of order or malformed; the client refuses it."""


class SecAggClientEngine:
    """Answer SecAgg+ stage messages for node `node_id`, keeping secrets in `state`.

    The server side is `server.secagg.engine.SecAggServerEngine`. The state record must be the
    same object across the four stages of a round (Flower's `context.state` provides that).
    """

    def __init__(self, node_id: int, state: ConfigRecord) -> None:
        self.node_id = node_id
        self.state = state

    def handle(self, content: RecordDict, contribute: Contribute) -> RecordDict:
        """Run the stage named in `content` and return the reply content."""
        rec = content.config_records.get(wire.SECAGG_RECORD)
        if rec is None:
            raise SecAggProtocolError(
                f"message has no {wire.SECAGG_RECORD!r} record; send it from the SecAgg+ aggregator"
            )
        stage = str(rec.get(wire.KEY_STAGE, ""))
        round_id = str(rec.get(wire.KEY_ROUND, ""))
        if stage == wire.STAGE_SETUP:
            self.state.clear()
            self.state[_S_ROUND] = round_id
        elif stage in _PREVIOUS:
            if self.state.get(_S_ROUND) != round_id or self.state.get(_S_STAGE) != _PREVIOUS[stage]:
                raise SecAggProtocolError(
                    f"stage {stage!r} of round {round_id} arrived after stage "
                    f"{self.state.get(_S_STAGE)!r} of round {self.state.get(_S_ROUND)!r}; "
                    "each round must run setup, share-keys, collect-masked-input, unmask in order"
                )
        else:
            raise SecAggProtocolError(
                f"unknown SecAgg+ stage {stage!r}; expected one of {wire.STAGES}"
            )
        handlers = {
            wire.STAGE_SETUP: lambda: self._setup(rec),
            wire.STAGE_SHARE_KEYS: lambda: self._share_keys(rec),
            wire.STAGE_COLLECT: lambda: self._collect(rec, contribute),
            wire.STAGE_UNMASK: lambda: self._unmask(rec),
        }
        reply = handlers[stage]()
        self.state[_S_STAGE] = stage
        if stage == wire.STAGE_UNMASK:
            self.state.clear()  # the round is over; forget every secret
        reply_rec = reply.config_records.get(wire.SECAGG_RECORD, ConfigRecord())
        reply_rec[wire.KEY_STAGE] = stage
        reply_rec[wire.KEY_ROUND] = round_id
        reply[wire.SECAGG_RECORD] = reply_rec
        return reply

    # ------------------------------------------------------------------ stages
    def _setup(self, rec: ConfigRecord) -> RecordDict:
        """Store the settings, create two key pairs and a self-mask seed; publish the public keys."""
        for key in _SETTINGS:
            if key not in rec:
                raise SecAggProtocolError(f"setup message lacks field {key!r}")
            self.state[key] = rec[key]
        self.state[wire.KEY_OMIT_ZERO] = wire.get_str_list(rec, wire.KEY_OMIT_ZERO)
        sk1, pk1 = generate_keypair()
        sk2, pk2 = generate_keypair()
        self.state[_S_SK1] = sk1
        self.state[_S_SK2] = sk2
        self.state[_S_SEED] = os.urandom(32)
        out = ConfigRecord({wire.KEY_PK1: pk1, wire.KEY_PK2: pk2})
        return RecordDict({wire.SECAGG_RECORD: out})

    def _share_keys(self, rec: ConfigRecord) -> RecordDict:
        """Shamir-share the seed and mask key among the peers; encrypt each share to its holder."""
        peers = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_PEERS))
        pk1s = wire.get_bytes_list(rec, wire.KEY_PEER_PK1)
        pk2s = wire.get_bytes_list(rec, wire.KEY_PEER_PK2)
        allowed = set(wire.unpack_ids(wire.get_bytes(self.state, wire.KEY_NEIGHBOURS))) | {
            self.node_id
        }
        threshold = int(wire.get_number(self.state, wire.KEY_THRESHOLD))
        if len(pk1s) != len(peers) or len(pk2s) != len(peers) or self.node_id not in peers:
            raise SecAggProtocolError("share-keys message: peer list and public keys do not match")
        if set(peers) - allowed:
            raise SecAggProtocolError(
                "share-keys message names peers outside this node's neighbours"
            )
        if len(set(pk1s)) != len(pk1s) or len(set(pk2s)) != len(pk2s):
            raise SecAggProtocolError("share-keys message repeats a public key; refusing")
        if len(peers) < threshold:
            raise SecAggProtocolError(
                f"only {len(peers)} peers left, below the reconstruction threshold {threshold}"
            )
        seed_shares = split_secret(wire.get_bytes(self.state, _S_SEED), threshold, len(peers))
        sk_shares = split_secret(wire.get_bytes(self.state, _S_SK1), threshold, len(peers))
        sk2 = wire.get_bytes(self.state, _S_SK2)
        dsts: list[int] = []
        cts: list[bytes] = []
        for peer, pk2, b_share, s_share in zip(peers, pk2s, seed_shares, sk_shares, strict=True):
            if peer == self.node_id:
                self._keep_shares(peer, b_share, s_share)
                continue
            key = fernet_key(agree(sk2, pk2, SHARE_PURPOSE))
            plain = share_keys_plaintext_concat(self.node_id, peer, b_share, s_share)
            dsts.append(peer)
            cts.append(encrypt(key, plain))
        self.state[_S_PEERS] = wire.pack_ids(peers)
        self.state[_S_PEER_PK1] = pk1s
        self.state[_S_PEER_PK2] = pk2s
        out = ConfigRecord({wire.KEY_DESTINATIONS: wire.pack_ids(dsts), wire.KEY_CIPHERTEXTS: cts})
        return RecordDict({wire.SECAGG_RECORD: out})

    def _collect(self, rec: ConfigRecord, contribute: Contribute) -> RecordDict:
        """Store peers' shares, train, then send the quantized input under self and pairwise masks."""
        sources = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SOURCES))
        cts = wire.get_bytes_list(rec, wire.KEY_CIPHERTEXTS)
        peers = wire.unpack_ids(wire.get_bytes(self.state, _S_PEERS))
        pk1 = dict(zip(peers, wire.get_bytes_list(self.state, _S_PEER_PK1), strict=True))
        pk2 = dict(zip(peers, wire.get_bytes_list(self.state, _S_PEER_PK2), strict=True))
        threshold = int(wire.get_number(self.state, wire.KEY_THRESHOLD))
        if len(sources) != len(cts) or len(set(sources)) != len(sources):
            raise SecAggProtocolError("collect message: sources and ciphertexts do not match")
        if set(sources) - set(peers) or self.node_id in sources:
            raise SecAggProtocolError("collect message forwards shares from non-peers")
        if len(sources) + 1 < threshold:
            raise SecAggProtocolError(
                f"only {len(sources)} peers shared keys; with threshold {threshold} this "
                "node's masks could not be protected, so it does not send its input"
            )
        sk2 = wire.get_bytes(self.state, _S_SK2)
        for src, ct in zip(sources, cts, strict=True):
            try:
                plain = decrypt(fernet_key(agree(sk2, pk2[src], SHARE_PURPOSE)), ct)
            except InvalidToken as exc:
                raise SecAggProtocolError(f"share from node {src} does not decrypt") from exc
            s, d, b_share, s_share = share_keys_plaintext_separate(plain)
            if s != src or d != self.node_id:
                raise SecAggProtocolError(f"share from node {src} is addressed {s}->{d}")
            self._keep_shares(src, b_share, s_share)
        self.state[_S_MASK_PEERS] = wire.pack_ids(sources)

        arrays = dict(contribute())
        for name in wire.get_str_list(self.state, wire.KEY_OMIT_ZERO):
            if name in arrays and np.any(arrays.pop(name)):
                raise SecAggProtocolError(
                    f"contribution {name!r} must be zero (FFA-LoRA freezes lora_A) but is not; "
                    "freeze it (dp-ffa-lora) or turn FFA-LoRA off on the server"
                )
        scales = wire.get_scales(self.state)
        layout = Layout.of(arrays, scales)
        modulus = int(wire.get_number(self.state, wire.KEY_MODULUS_RANGE))
        q = quantize(
            layout.flatten(arrays),
            wire.get_number(self.state, wire.KEY_CLIPPING_RANGE),
            int(wire.get_number(self.state, wire.KEY_QUANTIZATION_RANGE)),
            np.random.default_rng(),
        )
        # uint32 arithmetic wraps mod 2**32, a multiple of m: reduce mod m once at the end
        masked = q + prg_mask(wire.get_bytes(self.state, _S_SEED), layout.size, modulus)
        sk1 = wire.get_bytes(self.state, _S_SK1)
        for peer in sources:
            mask = prg_mask(agree(sk1, pk1[peer], MASK_PURPOSE), layout.size, modulus)
            if self.node_id < peer:
                masked += mask
            else:
                masked -= mask
        masked &= np.uint32(modulus - 1)
        record = ArrayRecord(
            {k: Array(np.ascontiguousarray(v)) for k, v in layout.split(masked).items()}
        )
        masked_name = str(self.state[wire.KEY_MASKED_RECORD])
        return RecordDict({masked_name: record})

    def _unmask(self, rec: ConfigRecord) -> RecordDict:
        """Reveal self-seed shares of live peers and mask-key shares of dropped peers, never both."""
        active = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_ACTIVE))
        dropped = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_DROPPED))
        mask_peers = set(wire.unpack_ids(wire.get_bytes(self.state, _S_MASK_PEERS)))
        if set(active) & set(dropped):
            raise SecAggProtocolError(
                "unmask message lists a node as both live and dropped; refusing"
            )
        if self.node_id not in active:
            raise SecAggProtocolError("unmask message lists this node as not live; refusing")
        if (set(active) | set(dropped)) - mask_peers - {self.node_id}:
            raise SecAggProtocolError(
                "unmask message asks for shares of nodes this node never masked with"
            )
        owners = wire.unpack_ids(wire.get_bytes(self.state, _S_OWNERS))
        seed_shares = dict(
            zip(owners, wire.get_bytes_list(self.state, _S_SEED_SHARES), strict=True)
        )
        sk_shares = dict(zip(owners, wire.get_bytes_list(self.state, _S_SK_SHARES), strict=True))
        out_owners = [u for u in active if u in seed_shares] + [
            u for u in dropped if u in sk_shares
        ]
        out_shares = [seed_shares[u] for u in active if u in seed_shares]
        out_shares += [sk_shares[u] for u in dropped if u in sk_shares]
        out = ConfigRecord(
            {wire.KEY_SHARE_OWNERS: wire.pack_ids(out_owners), wire.KEY_SHARES: out_shares}
        )
        return RecordDict({wire.SECAGG_RECORD: out})

    # ------------------------------------------------------------------ state helpers
    def _keep_shares(self, owner: int, seed_share: bytes, sk_share: bytes) -> None:
        owners = (
            wire.unpack_ids(wire.get_bytes(self.state, _S_OWNERS))
            if _S_OWNERS in self.state
            else []
        )
        if owner in owners:
            raise SecAggProtocolError(f"node {owner} sent its shares twice")
        self.state[_S_OWNERS] = wire.pack_ids([*owners, owner])
        self.state[_S_SEED_SHARES] = [*wire.get_bytes_list(self.state, _S_SEED_SHARES), seed_share]
        self.state[_S_SK_SHARES] = [*wire.get_bytes_list(self.state, _S_SK_SHARES), sk_share]
