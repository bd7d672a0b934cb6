"""Client half of SecAgg+ as a state machine whose state lives in a Flower ConfigRecord.

Keys are agreed once per server session: two X25519 key pairs, advertised when the
server asks and signed with the node's long-term Ed25519 identity
(:mod:`fedge.secagg.identity`); a neighbour's keys are accepted only with a valid
signature, under a key of the node's trust list when it holds one, and a node id's
identity is pinned for good (a new session never replaces it). The X25519 secret with
each neighbour is computed once per session and kept in the state beside the private
keys. Each round is then two exchanges. *Collect*: the client trains, masks its
quantized input with a fresh self mask and one pairwise mask per neighbour (seeded by
HKDF from the pair's X25519 secret, both node ids, the round id and the contribution
digest of everything its input depends on: model, config, every SecAgg+ number, the
round's graph and run, :mod:`fedge.secagg.binding`), and sends it with its self-mask seed
Shamir-shared among its neighbours only (it keeps no share itself), each share signed
by this node and encrypted to its holder (AES-GCM under a per-round HKDF key).
*Unmask*: it reveals the self-mask shares of live neighbours and, for dropped ones,
this round's pairwise seed, never both for one node and never a long-term key. A round
id is accepted once, so masks never repeat.

Why no active server unmasks one input (docs/privacy.md): a client accepts only a
threshold t with n >= t > n/2 of its n neighbours (:mod:`fedge.clients.secagg.rules`), and
unmasks only when the server's live and dropped lists split its neighbourhood with at
least t neighbours live. The victim's self-mask seed needs t neighbours told "v is
live" (they keep their pair seeds with v); its pair masks with the >= t neighbours the
victim was told are live need those neighbours told "v dropped" or summed with it. A
neighbour in both groups reveals its pair seed with v to nobody, and the two groups
share at least 2t - n > 0 members: any sum that holds the victim's unmasked input also
holds at least 2t - n of its neighbours' inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedge.clients.secagg.pins import PinStore
from fedge.clients.secagg.rules import (
    PIN_FIELDS,
    ClientRules,
    SecAggProtocolError,
    check_graph,
    check_identities,
    check_neighbourhood,
    check_numbers,
    check_unmask,
)
from fedge.secagg import identity as ident
from fedge.secagg import wire
from fedge.secagg.binding import contribution_digest
from fedge.secagg.crypto import (
    SHARE_PURPOSE,
    derive,
    generate_keypair,
    mask_info,
    pair_info,
    seal,
    shared_secrets,
    split_secret,
    unseal,
)
from fedge.secagg.vectors import Layout, prg_mask, quantize

Contribute = Callable[[], Mapping[str, np.ndarray]]

# Fields of the client's state record (wire.SECAGG_STATE_RECORD).
_S_SESSION = "session"
_S_SK1 = "sk1"
_S_SK2 = "sk2"
_S_PK1 = "pk1"
_S_PK2 = "pk2"
_S_PINNED = "pinned-ids"  # packed ids, parallel to _S_PINNED_PK1 / _S_PINNED_PK2
_S_PINNED_PK1 = "pinned-pk1"
_S_PINNED_PK2 = "pinned-pk2"
_S_PINNED_S1 = "pinned-s1"  # X25519 secrets with each pinned node (mask keys), once per session
_S_PINNED_S2 = "pinned-s2"  # the same for the share-encryption keys
_S_USED = "used-rounds"  # every round id this session has seen
_S_ROUND = "round"
_S_STAGE = "stage"
_S_NEIGHBOURS = "neighbours"
_S_THRESHOLD = "threshold"
_S_DIGEST = "content-digest"  # binds this round's pair seeds to the content sent
_S_ID_KEY = "identity-key"  # an engine without a key file signs with one kept here
_KEPT = (_S_ID_KEY, *PIN_FIELDS)  # survive a new key session
_SETTINGS = (
    wire.KEY_PEER_PK1,
    wire.KEY_PEER_PK2,
    wire.KEY_PEER_IDENTITY,
    wire.KEY_PEER_SIGNATURE,
    wire.KEY_THRESHOLD,
    wire.KEY_NEIGHBOURS,
    wire.KEY_GRAPH,
    wire.KEY_CLIPPING_RANGE,
    wire.KEY_QUANTIZATION_RANGE,
    wire.KEY_MODULUS_RANGE,
    wire.KEY_SCALE_NAMES,
    wire.KEY_SCALE_VALUES,
    wire.KEY_MASKED_RECORD,
)


class SecAggClientEngine:
    """Answer SecAgg+ stage messages for node ``node_id``, keeping secrets in ``state``.

    The server side is ``fedge.server.secagg.engine.SecAggServerEngine``. ``state`` must be the
    same record across a session's messages (Flower's ``context.state`` provides that);
    ``pins`` keeps neighbours' identity pins on the node's disk across runs (without it they
    live in ``state``, for one run).
    """

    def __init__(
        self,
        node_id: int,
        state: ConfigRecord,
        identity: Ed25519PrivateKey | None = None,
        rules: ClientRules | None = None,
        pins: PinStore | None = None,
    ) -> None:
        self.node_id = node_id
        self.pins = pins
        self.state = state
        self.identity = identity if identity is not None else self._state_identity()
        self.rules = rules if rules is not None else ClientRules()

    def handle(
        self, content: RecordDict, contribute: Contribute, run_id: int | None = None
    ) -> RecordDict:
        """Run the stage named in ``content`` and return the reply content.

        ``run_id`` (the Flower run the message belongs to) enters the contribution digest
        with everything else the collect stage depends on (:mod:`fedge.secagg.binding`)."""
        rec = content.config_records.get(wire.SECAGG_RECORD)
        if rec is None:
            raise SecAggProtocolError(
                f"message has no {wire.SECAGG_RECORD!r} record; send it from the SecAgg+ aggregator"
            )
        stage = str(rec.get(wire.KEY_STAGE, ""))
        session = str(rec.get(wire.KEY_SESSION, ""))
        if stage == wire.STAGE_ADVERTISE:
            out = self._advertise(session)
        elif self.state.get(_S_SESSION) != session:
            raise SecAggProtocolError(
                f"stage {stage!r} of key session {session!r}, but this node holds keys of "
                f"session {self.state.get(_S_SESSION)!r}; the server must ask it to advertise keys"
            )
        elif stage == wire.STAGE_COLLECT:
            out = self._collect(rec, contribute, contribution_digest(content, run_id).whole)
        elif stage == wire.STAGE_UNMASK:
            out = self._unmask(rec)
        else:
            raise SecAggProtocolError(
                f"unknown SecAgg+ stage {stage!r}; expected one of {wire.STAGES}"
            )
        reply_rec = out.config_records.get(wire.SECAGG_RECORD, ConfigRecord())
        reply_rec[wire.KEY_STAGE] = stage
        reply_rec[wire.KEY_SESSION] = session
        if wire.KEY_ROUND in rec:
            reply_rec[wire.KEY_ROUND] = rec[wire.KEY_ROUND]
        out[wire.SECAGG_RECORD] = reply_rec
        return out

    # ------------------------------------------------------------------ stages
    def _advertise(self, session: str) -> RecordDict:
        """Create this session's two key pairs (once) and publish the public keys."""
        if not session:
            raise SecAggProtocolError("advertise-keys message has no session id")
        if self.state.get(_S_SESSION) != session:
            kept = {k: self.state[k] for k in _KEPT if k in self.state}
            self.state.clear()
            self.state.update(kept)
            self.state[_S_SESSION] = session
            self.state[_S_SK1], self.state[_S_PK1] = generate_keypair()
            self.state[_S_SK2], self.state[_S_PK2] = generate_keypair()
            self.state[_S_USED] = []
        pk1, pk2 = wire.get_bytes(self.state, _S_PK1), wire.get_bytes(self.state, _S_PK2)
        out = ConfigRecord(
            {
                wire.KEY_PK1: pk1,
                wire.KEY_PK2: pk2,
                wire.KEY_IDENTITY: ident.public_bytes(self.identity),
                wire.KEY_SIGNATURE: ident.sign_advert(
                    self.identity, session, self.node_id, pk1, pk2
                ),
            }
        )
        return RecordDict({wire.SECAGG_RECORD: out})

    def _collect(self, rec: ConfigRecord, contribute: Contribute, digest: bytes) -> RecordDict:
        """Check the round, train, mask; return the masked input and the encrypted seed shares."""
        round_id = str(rec.get(wire.KEY_ROUND, ""))
        used = wire.get_str_list(self.state, _S_USED)
        if not round_id or round_id in used:
            raise SecAggProtocolError(
                f"round id {round_id!r} was already used in this session; reusing it would repeat "
                "this node's pairwise masks, so it refuses"
            )
        for key in _SETTINGS:
            if key not in rec:
                raise SecAggProtocolError(f"collect message lacks field {key!r}")
        masked_name = rec[wire.KEY_MASKED_RECORD]
        if not isinstance(masked_name, str) or masked_name in ("", wire.SECAGG_RECORD):
            raise SecAggProtocolError("collect message names an unusable masked-record; refusing")
        neighbours = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_NEIGHBOURS))
        threshold, clip, levels, modulus = check_numbers(rec)
        check_neighbourhood(self.node_id, neighbours, threshold, self.rules)
        check_graph(self.node_id, neighbours, threshold, wire.get_bytes(rec, wire.KEY_GRAPH))
        self._check_keys(
            neighbours,
            wire.get_bytes_list(rec, wire.KEY_PEER_PK1),
            wire.get_bytes_list(rec, wire.KEY_PEER_PK2),
            wire.get_bytes_list(rec, wire.KEY_PEER_IDENTITY),
            wire.get_bytes_list(rec, wire.KEY_PEER_SIGNATURE),
        )
        self.state[_S_USED] = [*used, round_id]
        self.state[_S_DIGEST] = digest
        self.state[_S_ROUND] = round_id
        self.state[_S_STAGE] = wire.STAGE_COLLECT
        self.state[_S_NEIGHBOURS] = wire.pack_ids(neighbours)
        self.state[_S_THRESHOLD] = threshold

        arrays = dict(contribute())
        for name in wire.get_str_list(rec, wire.KEY_OMIT_ZERO):
            if name in arrays and np.any(arrays.pop(name)):
                raise SecAggProtocolError(
                    f"contribution {name!r} must be zero (FFA-LoRA freezes lora_A) but is not; "
                    "freeze it (dp-ffa-lora) or turn FFA-LoRA off on the server"
                )
        layout = Layout.of(arrays, wire.get_scales(rec))
        q = quantize(layout.flatten(arrays), clip, levels, np.random.default_rng())
        seed = os.urandom(32)  # fresh self mask every round
        # uint32 arithmetic wraps mod 2**32, a multiple of m: reduce mod m once at the end
        masked = q + prg_mask(seed, layout.size, modulus)
        s1, s2 = self._secrets(neighbours)
        for peer in neighbours:
            mask = prg_mask(self._pair_seed(peer, s1[peer], round_id), layout.size, modulus)
            if self.node_id < peer:
                masked += mask
            else:
                masked -= mask
        masked &= np.uint32(modulus - 1)

        shares = split_secret(seed, threshold, len(neighbours))  # none kept: see the module doc
        session = str(self.state[_S_SESSION])
        cts = [  # each share signed by this node, so a share that fails is attributed
            seal(
                self._share_key(peer, s2[peer], round_id),
                ident.sign_share(self.identity, session, round_id, self.node_id, peer, share),
                _share_context(self.node_id, peer),
            )
            for peer, share in zip(neighbours, shares, strict=True)
        ]
        out = ConfigRecord(
            {wire.KEY_DESTINATIONS: wire.pack_ids(neighbours), wire.KEY_CIPHERTEXTS: cts}
        )
        masked_record = ArrayRecord(
            {k: Array(np.ascontiguousarray(v)) for k, v in layout.split(masked).items()}
        )
        return RecordDict(
            {wire.SECAGG_RECORD: out, str(rec[wire.KEY_MASKED_RECORD]): masked_record}
        )

    def _unmask(self, rec: ConfigRecord) -> RecordDict:
        """Reveal self-mask shares of live neighbours and this round's seeds with dropped ones."""
        round_id = str(rec.get(wire.KEY_ROUND, ""))
        if self.state.get(_S_ROUND) != round_id or self.state.get(_S_STAGE) != wire.STAGE_COLLECT:
            raise SecAggProtocolError(
                f"unmask of round {round_id!r} arrived, but this node's last step was "
                f"{self.state.get(_S_STAGE)!r} of round {self.state.get(_S_ROUND)!r}; each round "
                "runs collect-masked-input, then one unmask"
            )
        self.state[_S_STAGE] = wire.STAGE_UNMASK  # one unmask per round, even if this one fails
        active = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_ACTIVE))
        dropped = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_DROPPED))
        neighbours = wire.unpack_ids(wire.get_bytes(self.state, _S_NEIGHBOURS))
        threshold = int(wire.get_number(self.state, _S_THRESHOLD))
        sources = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SOURCES))
        cts = wire.get_bytes_list(rec, wire.KEY_CIPHERTEXTS)
        check_unmask(self.node_id, neighbours, threshold, active, dropped, sources)
        if len(sources) != len(cts):
            raise SecAggProtocolError(
                "unmask message forwards shares that do not match live neighbours"
            )
        s1, s2 = self._secrets(neighbours)
        owners: list[int] = []
        shares: list[bytes] = []
        for src, ct in zip(sources, cts, strict=True):
            key = self._share_key(src, s2[src], round_id)
            try:  # the context binds sender and receiver: a share forwarded elsewhere fails
                share = unseal(key, ct, _share_context(src, self.node_id))
            except ValueError as exc:
                raise SecAggProtocolError(
                    f"share from node {src} does not decrypt as addressed to this node"
                ) from exc
            owners.append(src)
            shares.append(share)
        seeds = [self._pair_seed(u, s1[u], round_id) for u in dropped]
        out = ConfigRecord(
            {
                wire.KEY_SHARE_OWNERS: wire.pack_ids(owners),
                wire.KEY_SHARES: shares,
                wire.KEY_SEED_PEERS: wire.pack_ids(dropped),
                wire.KEY_SEEDS: seeds,
            }
        )
        return RecordDict({wire.SECAGG_RECORD: out})

    # ------------------------------------------------------------------ helpers
    def _check_keys(
        self,
        ids: list[int],
        pk1s: list[bytes],
        pk2s: list[bytes],
        idents: list[bytes],
        sigs: list[bytes],
    ) -> None:
        """Refuse repeated, unsigned, untrusted or replaced keys; pin the rest for the session."""
        n = len(ids)
        if not len(pk1s) == len(pk2s) == len(idents) == len(sigs) == n:
            raise SecAggProtocolError(
                "collect message: neighbours, public keys and signatures do not match (rule: "
                "every neighbour's keys come signed by its identity)"
            )
        own = (self.state[_S_PK1], self.state[_S_PK2], ident.public_bytes(self.identity))
        for mine, theirs in zip(own, (pk1s, pk2s, idents), strict=True):
            if len(set(theirs) | {mine}) != n + 1:
                raise SecAggProtocolError(
                    "collect message repeats a public key or identity (or this node's own); "
                    "refusing"
                )
        pinned = self._pinned_ids()
        p1 = dict(zip(pinned, wire.get_bytes_list(self.state, _S_PINNED_PK1), strict=True))
        p2 = dict(zip(pinned, wire.get_bytes_list(self.state, _S_PINNED_PK2), strict=True))
        fresh = [i for i, u in enumerate(ids) if u not in p1]
        for u, a, b in zip(ids, pk1s, pk2s, strict=True):
            if u in p1 and (p1[u] != a or p2[u] != b):
                raise SecAggProtocolError(
                    f"the public keys of node {u} changed within key session "
                    f"{self.state.get(_S_SESSION)!r}; refusing (a server may be impersonating it)"
                )
        if not fresh:  # steady state: every neighbour verified and pinned, nothing to do
            return
        adverts = [(ids[i], pk1s[i], pk2s[i], idents[i], sigs[i]) for i in fresh]
        session = str(self.state.get(_S_SESSION, ""))
        check_identities(self.state, session, adverts, self.rules, self.pins)
        self._pin([ids[i] for i in fresh], [pk1s[i] for i in fresh], [pk2s[i] for i in fresh])

    def _state_identity(self) -> Ed25519PrivateKey:
        """A signing key kept in the state: for engines given no key file (tests, one run)."""
        if _S_ID_KEY not in self.state:
            self.state[_S_ID_KEY] = ident.private_bytes(Ed25519PrivateKey.generate())
        return Ed25519PrivateKey.from_private_bytes(wire.get_bytes(self.state, _S_ID_KEY))

    def _pin(self, fresh: list[int], pk1s: list[bytes], pk2s: list[bytes]) -> None:
        """Bind the verified keys of ``fresh`` node ids for the session and compute their
        X25519 secrets once."""
        pinned = self._pinned_ids()
        p1 = dict(zip(pinned, wire.get_bytes_list(self.state, _S_PINNED_PK1), strict=True))
        p2 = dict(zip(pinned, wire.get_bytes_list(self.state, _S_PINNED_PK2), strict=True))
        p1.update(zip(fresh, pk1s, strict=True))
        p2.update(zip(fresh, pk2s, strict=True))
        s1, s2 = self._secrets(pinned)
        sk1, sk2 = wire.get_bytes(self.state, _S_SK1), wire.get_bytes(self.state, _S_SK2)
        s1.update(zip(fresh, shared_secrets(sk1, pk1s), strict=True))
        s2.update(zip(fresh, shared_secrets(sk2, pk2s), strict=True))
        order = sorted(p1)
        self.state[_S_PINNED] = wire.pack_ids(order)
        self.state[_S_PINNED_PK1] = [p1[u] for u in order]
        self.state[_S_PINNED_PK2] = [p2[u] for u in order]
        self.state[_S_PINNED_S1] = [s1[u] for u in order]
        self.state[_S_PINNED_S2] = [s2[u] for u in order]

    def _pinned_ids(self) -> list[int]:
        if _S_PINNED not in self.state:
            return []
        return wire.unpack_ids(wire.get_bytes(self.state, _S_PINNED))

    def _secrets(self, ids: list[int]) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """The session's X25519 secrets with ``ids`` (mask, share encryption), all pinned."""
        pinned = self._pinned_ids()
        s1 = dict(zip(pinned, wire.get_bytes_list(self.state, _S_PINNED_S1), strict=True))
        s2 = dict(zip(pinned, wire.get_bytes_list(self.state, _S_PINNED_S2), strict=True))
        return {u: s1[u] for u in ids}, {u: s2[u] for u in ids}

    def _pair_seed(self, peer: int, secret: bytes, round_id: str) -> bytes:
        """This round's pairwise mask seed with ``peer``: HKDF over the pair's X25519 secret,
        bound to the digest of the content this node was sent (:mod:`fedge.secagg.binding`)."""
        digest = wire.get_bytes(self.state, _S_DIGEST)
        return derive(secret, mask_info(self.node_id, peer, round_id, digest))

    def _share_key(self, peer: int, secret: bytes, round_id: str) -> bytes:
        """This round's key for the shares exchanged with ``peer``."""
        return derive(secret, pair_info(SHARE_PURPOSE, self.node_id, peer, round_id))


def _share_context(src: int, dst: int) -> bytes:
    """What a sealed share is bound to: its sender and its receiver."""
    return wire.pack_ids([src, dst])
