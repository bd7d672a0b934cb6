"""A malicious SecAgg+ server that deviates at random, per client, in any field of any message.

Not a list of known attacks: every seeded trial runs honest key sessions and rounds
through fedge's real server engine for the protocol's bookkeeping, and, per client,
rewrites fields of the messages it sends (numbers, lists, packed node ids, the round
graph, records and config, the global model, keys and identities, run and round ids,
replays, stage order, drop-out lists, forwarded shares), then tries every recovery it
knows with all it collected:

* **solve**: for each client, its masked input minus its self mask (rebuilt from any
  revealed shares) minus every pair mask (from a pair seed either end revealed), decoded
  with the numbers that client was sent;
* **sum**: the server engine's own unmasked "sum" of the round;
* **difference**: two sums of one key session subtracted;
* **oracle**: every reply's metrics, fields and refusal texts, searched for a client's
  private values.

A recovery *breaks the promise* when it equals (to 0.05 per value, far below the inputs'
spread) the sum of the inputs of a set S of clients smaller than some member ``v`` of S
accepts: ``1 + 2 t_v - n_v`` for the threshold and neighbourhood ``v`` accepted (fedge's
SecAgg+ guarantee, docs/privacy.md), or when a private value appears in clear. The
policy-level classes (``dp-numbers``, ``model-encoding``) check the distributed-DP noise a
client accepts against its policy floor and ``once-per-model`` against re-encodings.

Clients are fedge's real ClientApp stack (:func:`fedge.clients.mods.dispatch_mods`, the
SecAgg+ mod, pins and identity keys on disk, a trust list of every node, a policy), called
in-process: no transport, tiny vectors, so thousands of deviations run in a minute. Each
key session draws one of two client stacks (:data:`STACKS`): ``secagg`` (SecAgg+ alone) or
``distributed-dp`` (SecAgg+ with the distributed-DP mod under a strict DP policy: every
honest collect carries the clip and noise numbers). On the DP stack the harness records
what each client's mod actually clipped and noised (:func:`released_by_clients`), judges
recoveries against those noised inputs, reports any recovery equal to a sum of un-noised
ones, and checks every accepted round's real noise against the client's policy:
std x sqrt(m) >= min-noise x C with m the contributors it verified and C <= max-clip.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from fedge import keys
from fedge.clients.mods import dispatch_mods
from fedge.clients.privacy import mods as dp_mods
from fedge.clients.privacy.ledger import NODE_STATE_DIR_KEY
from fedge.clients.privacy.policy import (
    NODE_POLICY_KEY,
    PolicyRefusal,
    PrivacyPolicy,
    check_train,
    verified_contributors,
)
from fedge.clients.secagg.mod import write_trust_list
from fedge.privacy.wire import KEY_DP_CLIP, KEY_DP_MIN_CLIENTS, KEY_DP_NOISE_STD
from fedge.secagg import identity, wire
from fedge.secagg.config import SecAggConfig
from fedge.secagg.crypto import combine_secret, generate_keypair
from fedge.secagg.identity import SIGNATURE_BYTES
from fedge.secagg.vectors import Layout, dequantize_sum, prg_mask
from fedge.server.secagg.engine import KeyBook, SecAggRoundFailed, SecAggServerEngine

SIZE = 6  # values per input: tiny, the protocol's cost is per message, not per value
TOLERANCE = 0.05  # a recovery within this of a sum (per value) counts; inputs spread ~0.5
ROUNDS_PER_SESSION = 4
COLLECT_CLASSES = (
    "number",
    "list",
    "neighbours",
    "graph",
    "round-id",
    "replay",
    "session",
    "record",
    "config",
    "model",
    "keys",
    "run-id",
    "masked-record",
    "dp-config",
)
UNMASK_CLASSES = ("dropout-lists", "forward", "order")
POLICY_CLASSES = ("dp-numbers", "model-encoding")
CLASSES = (*COLLECT_CLASSES, *UNMASK_CLASSES, "cohort-difference", *POLICY_CLASSES)
POLICY = 'require-secagg = true\nsecagg-min-neighbours = 2\ntrusted-keys = "trust.txt"\n'
STACK_SECAGG, STACK_DP = "secagg", "distributed-dp"
STACKS = (STACK_SECAGG, STACK_DP)
MIN_NOISE, MAX_CLIP = 1.0, 1.0  # the DP stack's policy floor and ceiling
DP_POLICY = POLICY + f"require-dp = true\nmin-noise = {MIN_NOISE}\nmax-clip = {MAX_CLIP}\n"
# The honest distributed-DP numbers: C = 1 and per-client std 1, so z >= 1 for any m >= 1.
DP_CONFIG = {KEY_DP_CLIP: 1.0, KEY_DP_NOISE_STD: 1.0, KEY_DP_MIN_CLIENTS: 1, "weighting": "uniform"}


@dataclass
class Report:
    """What a run did: deviations per class, outcomes, and every broken promise found."""

    deviations: Counter[str] = field(default_factory=Counter)
    stacks: Counter[str] = field(default_factory=Counter)  # deviations per client stack
    outcomes: Counter[str] = field(default_factory=Counter)
    recoveries_tried: int = 0
    breaches: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.deviations.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "deviations": self.total,
            "by_class": dict(sorted(self.deviations.items())),
            "by_stack": dict(sorted(self.stacks.items())),
            "outcomes": dict(sorted(self.outcomes.items())),
            "recoveries_tried": self.recoveries_tried,
            "breaches": self.breaches,
        }


@contextmanager
def server_identity() -> Iterator[None]:
    """Messages are built as the ServerApp builds them (Flower reads the task identity)."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)  # type: ignore[attr-defined]
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = 1, 1, SUPERLINK_NODE_ID  # type: ignore[attr-defined]
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved  # type: ignore[attr-defined]


@dataclass
class Release:
    """What one client's distributed-DP mod did this round: its clipped input, the noised
    one it masked, and the clip and std it used (recorded by :func:`released_by_clients`)."""

    clipped: dict[str, np.ndarray]
    noised: dict[str, np.ndarray]
    clip: float
    std: float


_RECORDING: list[Federation] = []  # the federation whose clients are being asked


@contextmanager
def released_by_clients() -> Iterator[None]:
    """Record every client's distributed-DP release (``clip_contribution`` and
    ``add_gaussian_noise`` as the client's mod calls them) into the asking federation."""
    clip_fn, noise_fn = dp_mods.clip_contribution, dp_mods.add_gaussian_noise
    pending: dict[str, Any] = {}

    def clip(arrays: Any, clip_norm: float) -> Any:
        pending["clip"] = clip_norm
        return clip_fn(arrays, clip_norm)

    def noise(summed: Any, std: float, skip: frozenset[str] = frozenset()) -> Any:
        out = noise_fn(summed, std, skip)
        if _RECORDING:
            fed = _RECORDING[-1]
            fed.released[fed.asking] = Release(dict(summed), dict(out), pending["clip"], std)
        return out

    dp_mods.clip_contribution, dp_mods.add_gaussian_noise = clip, noise  # type: ignore[assignment]
    try:
        yield
    finally:
        dp_mods.clip_contribution, dp_mods.add_gaussian_noise = clip_fn, noise_fn  # type: ignore[assignment]


class Federation:
    """``n`` client nodes on disk (identity keys, pins, trust list, policy) and their inputs,
    on one client stack (:data:`STACKS`)."""

    def __init__(self, root: Path, n: int, rng: random.Random, stack: str = STACK_SECAGG) -> None:
        self.root = root
        self.stack = stack
        self.nodes = [1000 + 7 * i + rng.randrange(7) for i in range(n)]
        self.partition = {u: i for i, u in enumerate(self.nodes)}
        self.released: dict[int, Release] = {}  # this round's distributed-DP releases
        self.asking = 0
        (root / "policy.toml").write_text(DP_POLICY if stack == STACK_DP else POLICY)
        write_trust_list(root / "state", range(n), root / "trust.txt")
        self.contexts = {u: self.context(u, 1) for u in self.nodes}
        self.inputs: dict[int, dict[str, np.ndarray]] = {}
        self.losses: dict[int, float] = {}
        self.np_rng = np.random.default_rng(rng.randrange(2**32))

    def context(self, node: int, run: int) -> Context:
        config = {
            keys.NODE_PARTITION_ID: self.partition[node],
            NODE_STATE_DIR_KEY: str(self.root / "state"),
            NODE_POLICY_KEY: str(self.root / "policy.toml"),
        }
        return Context(
            run_id=run, node_id=node, node_config=config, state=RecordDict(), run_config={}
        )

    def fresh_inputs(self) -> None:
        """Every round's inputs are new (real updates change), so no old sum explains a new one."""
        for u in self.nodes:
            self.inputs[u] = {
                "delta/w": self.np_rng.normal(0, 0.5, SIZE).astype(np.float32),
                keys.KEY_WEIGHT: np.ones(1, np.float32),
            }
            self.losses[u] = float(round(self.np_rng.uniform(1.0, 9.0), 6))
        self.released = {}

    def honest_config(self) -> ConfigRecord:
        """The train config an honest server sends on this stack."""
        return ConfigRecord({"lr": 0.1, **(DP_CONFIG if self.stack == STACK_DP else {})})

    def truth(self, node: int) -> np.ndarray:
        """``node``'s input as it entered the masks: noised on the DP stack (float64)."""
        if self.stack == STACK_DP and node in self.released:
            return self.released[node].noised["delta/w"].astype(np.float64)
        return self.inputs[node]["delta/w"].astype(np.float64)

    def ask(self, node: int, content: RecordDict, run_id: int = 1) -> Message:
        """Deliver ``content`` to ``node`` through fedge's client stack; return its reply."""

        def train(msg: Message, _: Context) -> Message:
            """The update scales with the learning rate the server sent (0: no update)."""
            lr = msg.content.config_records.get(keys.REC_CONFIG, ConfigRecord()).get("lr", 0.1)
            try:
                scale = float(str(lr)) / 0.1
            except ValueError:
                scale = 1.0
            arrays = dict(self.inputs[node])
            arrays["delta/w"] = (arrays["delta/w"] * np.float32(scale)).astype(np.float32)
            record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
            metrics = MetricRecord({keys.MET_TRAIN_LOSS: self.losses[node]})
            return Message(
                RecordDict({keys.REC_CONTRIB: record, keys.REC_METRICS: metrics}), reply_to=msg
            )

        saved = TaskIdentity._run_id  # type: ignore[attr-defined]
        TaskIdentity._run_id = run_id  # type: ignore[attr-defined]
        try:
            msg = Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
        finally:
            TaskIdentity._run_id = saved  # type: ignore[attr-defined]
        self.asking = node
        _RECORDING.append(self)
        try:
            return dispatch_mods(msg, self.contexts[node], train)
        finally:
            _RECORDING.pop()


# ---------------------------------------------------------------------- deviations
def _mutate_number(rng: random.Random, x: float) -> float | int:
    choice = rng.randrange(9)
    return [
        x * 1e30,
        x * 1e-30,
        0,
        -x,
        math.nan,
        math.inf,
        x + 1,
        x * (1 + 1e-9),
        2 ** rng.randrange(1, 40),
    ][choice]


def _mutate_list(rng: random.Random, xs: list[Any]) -> list[Any]:
    xs = list(xs)
    op = rng.randrange(4)
    if op == 0 and xs:
        xs.pop(rng.randrange(len(xs)))
    elif op == 1 and xs:
        xs.append(xs[rng.randrange(len(xs))])
    elif op == 2:
        xs.reverse()
        if len(xs) < 2:
            xs.append(rng.randbytes(32) if not xs or isinstance(xs[0], bytes) else "w")
    else:
        new: Any = rng.randbytes(32) if not xs or isinstance(xs[0], bytes) else "delta/w"
        xs[rng.randrange(len(xs)) if xs else 0 : (rng.randrange(len(xs)) + 1) if xs else 0] = [new]
    return xs


def deviate_collect(
    kind: str,
    rng: random.Random,
    fed: Federation,
    node: int,
    req: RecordDict,
    past: list[RecordDict],
) -> int:
    """Rewrite ``node``'s collect request in place by one deviation of class ``kind``; return
    the run id to send it under."""
    rec = req[wire.SECAGG_RECORD]
    assert isinstance(rec, ConfigRecord)
    run_id = 1
    if kind == "number":
        key = rng.choice(
            [
                wire.KEY_CLIPPING_RANGE,
                wire.KEY_QUANTIZATION_RANGE,
                wire.KEY_MODULUS_RANGE,
                wire.KEY_THRESHOLD,
            ]
        )
        rec[key] = _mutate_number(rng, float(rec[key]))  # type: ignore[arg-type]
    elif kind == "list":
        key = rng.choice(
            [
                wire.KEY_SCALE_NAMES,
                wire.KEY_SCALE_VALUES,
                wire.KEY_OMIT_ZERO,
                wire.KEY_PEER_PK1,
                wire.KEY_PEER_PK2,
                wire.KEY_PEER_IDENTITY,
                wire.KEY_PEER_SIGNATURE,
            ]
        )
        if key == wire.KEY_SCALE_VALUES:
            values = list(rec[key])  # type: ignore[arg-type]
            i = rng.randrange(len(values))
            values[i] = float(_mutate_number(rng, float(values[i])))
            rec[key] = values
        else:
            rec[key] = _mutate_list(rng, list(rec.get(key, [])))  # type: ignore[arg-type]
    elif kind == "neighbours":
        hood = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_NEIGHBOURS))
        others = [u for u in fed.nodes if u != node and u not in hood] + [999_999]
        op = rng.randrange(3)
        if op == 0 and hood:
            hood.pop(rng.randrange(len(hood)))
        elif op == 1:
            hood.append(rng.choice(others))
        elif hood:
            hood[rng.randrange(len(hood))] = rng.choice(others)
        rec[wire.KEY_NEIGHBOURS] = wire.pack_ids(sorted(hood))
        if rng.random() < 0.5:  # and a graph that agrees with it (but not with the others')
            graph = wire.unpack_graph(wire.get_bytes(rec, wire.KEY_GRAPH))
            graph[node] = (int(rec[wire.KEY_THRESHOLD]), sorted(hood))  # type: ignore[arg-type]
            for u in hood:
                t, h = graph.get(u, (1, []))
                graph[u] = (t, sorted(set(h) | {node}))
            rec[wire.KEY_GRAPH] = wire.pack_graph(graph)
    elif kind == "graph":
        graph = wire.unpack_graph(wire.get_bytes(rec, wire.KEY_GRAPH))
        u = rng.choice(sorted(graph))
        t, h = graph[u]
        graph[u] = (max(1, t + rng.choice([-1, 1])), h) if rng.random() < 0.5 else (t, h[:-1])
        rec[wire.KEY_GRAPH] = wire.pack_graph(graph)
        if u == node:
            rec[wire.KEY_THRESHOLD] = graph[u][0]
    elif kind == "round-id":
        rec[wire.KEY_ROUND] = rng.randbytes(8).hex()
    elif kind == "replay" and past:
        old = rng.choice(past)
        for name in list(req):
            del req[name]
        for name, record in old.items():
            req[name] = record
    elif kind == "session":
        rec[wire.KEY_SESSION] = rng.randbytes(8).hex()
    elif kind == "record":
        op = rng.randrange(3)
        if op == 0:
            rec["x-" + rng.randbytes(2).hex()] = rng.random()
        elif op == 1:
            req["extra-" + rng.randbytes(2).hex()] = ConfigRecord({"x": rng.random()})
        else:
            req["extra"] = ArrayRecord({"x": Array(np.zeros(2, np.float32))})
    elif kind == "config":
        cfg = req[keys.REC_CONFIG]
        assert isinstance(cfg, ConfigRecord)
        cfg["lr"] = rng.choice([0.0, -0.0, 1e30, 0.1 + 1e-12, "0.1"])
    elif kind == "model":
        w = np.asarray(req[keys.REC_GLOBAL]["w"].numpy())  # type: ignore[index, union-attr]
        op = rng.randrange(3)
        if op == 0:
            w = w.copy()
            w[rng.randrange(w.size)] += 1e-3
        elif op == 1:
            w = w.astype(np.float64)  # the same model, another encoding: one digest
            w[0] = 1e-300  # and a value a float32 client would read differently
        else:
            w = -w
        req[keys.REC_GLOBAL] = ArrayRecord({"w": Array(w)})
    elif kind == "keys":  # a neighbour's keys replaced by the server's, signed by its identity
        peers = rec.get(wire.KEY_PEER_PK1, [])
        if peers:
            i = rng.randrange(len(peers))  # type: ignore[arg-type]
            hood = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_NEIGHBOURS))
            (_, pk1), (_, pk2) = generate_keypair(), generate_keypair()
            forged = identity_forgery(hood[i], str(rec[wire.KEY_SESSION]), pk1, pk2)
            for key, value in ((wire.KEY_PEER_PK1, pk1), (wire.KEY_PEER_PK2, pk2), *forged):
                values = list(rec[key])  # type: ignore[arg-type]
                values[i] = value
                rec[key] = values
    elif kind == "run-id":
        run_id = rng.choice([2, 3, 2**40])
    elif kind == "masked-record":
        rec[wire.KEY_MASKED_RECORD] = rng.choice(["m2", keys.REC_CONTRIB, wire.SECAGG_RECORD])
    elif kind == "dp-config":  # this client's clip, noise or contributor count, alone
        cfg = req[keys.REC_CONFIG]
        assert isinstance(cfg, ConfigRecord)
        key = rng.choice([KEY_DP_CLIP, KEY_DP_NOISE_STD, KEY_DP_MIN_CLIENTS])
        if key in cfg and rng.random() < 0.2:
            del cfg[key]
        else:
            base = float(str(cfg.get(key, 1.0)))
            cfg[key] = rng.choice([_mutate_number(rng, base), 0.5, 0.0, 1e-9, 2.0, "0.5"])
    return run_id


def identity_forgery(node: int, session: str, pk1: bytes, pk2: bytes) -> list[tuple[str, bytes]]:
    """An identity the server made, validly signing the server's keys for ``node``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    return [
        (wire.KEY_PEER_IDENTITY, identity.public_bytes(key)),
        (wire.KEY_PEER_SIGNATURE, identity.sign_advert(key, session, node, pk1, pk2)),
    ]


def deviate_unmask(
    kind: str, rng: random.Random, fed: Federation, node: int, req: RecordDict
) -> None:
    """Rewrite ``node``'s unmask request in place by one deviation of class ``kind``."""
    rec = req[wire.SECAGG_RECORD]
    assert isinstance(rec, ConfigRecord)
    if kind == "dropout-lists":
        everyone = set(wire.unpack_ids(wire.get_bytes(rec, wire.KEY_ACTIVE))) | set(
            wire.unpack_ids(wire.get_bytes(rec, wire.KEY_DROPPED))
        )
        others = sorted(everyone - {node})
        dropped = sorted(rng.sample(others, rng.randrange(len(others) + 1)))
        active = sorted(everyone - set(dropped))
        if rng.random() < 0.2:
            active = sorted(set(active) | set(dropped[:1]))  # one node both live and dropped
        rec[wire.KEY_ACTIVE] = wire.pack_ids(active)
        rec[wire.KEY_DROPPED] = wire.pack_ids(dropped)
        srcs = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SOURCES))
        cts = list(rec[wire.KEY_CIPHERTEXTS])  # type: ignore[arg-type]
        keep = [i for i, s in enumerate(srcs) if s in active]
        rec[wire.KEY_SOURCES] = wire.pack_ids([srcs[i] for i in keep])
        rec[wire.KEY_CIPHERTEXTS] = [cts[i] for i in keep]
    elif kind == "forward":
        srcs = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_SOURCES))
        cts = list(rec[wire.KEY_CIPHERTEXTS])  # type: ignore[arg-type]
        op = rng.randrange(3)
        if op == 0 and len(cts) > 1:
            cts.reverse()
        elif op == 1 and srcs:
            srcs[rng.randrange(len(srcs))] = rng.choice(fed.nodes)
        elif cts:
            cts[0] = cts[0][:-1] + bytes([cts[0][-1] ^ 1])
        rec[wire.KEY_SOURCES] = wire.pack_ids(srcs)
        rec[wire.KEY_CIPHERTEXTS] = cts


# ---------------------------------------------------------------------- recovery
@dataclass
class Seen:
    """Everything the server collected in one round: what it sent and every reply."""

    sent: dict[int, ConfigRecord] = field(default_factory=dict)  # collect record per client
    masked: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    shares: dict[int, list[bytes]] = field(default_factory=dict)  # owner -> shares
    seeds: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (revealer, peer) -> seed
    accepted: dict[int, int] = field(default_factory=dict)  # client -> least set size it allows
    replies: list[Message] = field(default_factory=list)


def solve(seen: Seen, victim: int) -> list[dict[str, np.ndarray]]:
    """Every input of ``victim`` the server can compute from the secrets it was handed."""
    rec, masked = seen.sent.get(victim), seen.masked.get(victim)
    if rec is None or masked is None:
        return []
    hood = wire.unpack_ids(wire.get_bytes(rec, wire.KEY_NEIGHBOURS))
    choices = []
    for u in hood:
        options = [seen.seeds[k] for k in ((victim, u), (u, victim)) if k in seen.seeds]
        if not options:
            return []
        choices.append(options)
    raw = [s[:-SIGNATURE_BYTES] if len(s) > 68 else s for s in seen.shares.get(victim, [])]
    seeds = []
    for group in (raw, raw[: int(rec[wire.KEY_THRESHOLD])]):  # type: ignore[call-overload]
        try:
            seeds.append(combine_secret(group))
        except (ValueError, ZeroDivisionError):
            continue
    m, clip = int(rec[wire.KEY_MODULUS_RANGE]), float(rec[wire.KEY_CLIPPING_RANGE])  # type: ignore[arg-type]
    levels = int(rec[wire.KEY_QUANTIZATION_RANGE])  # type: ignore[call-overload]
    layout = Layout.of(masked, wire.get_scales(rec))
    out = []
    for self_seed in seeds:
        for combo in itertools.product(*choices):
            total = layout.flatten({k: v.astype(np.float64) for k, v in masked.items()})
            total = total.astype(np.uint64).astype(np.uint32)
            total -= prg_mask(self_seed, layout.size, m)
            for u, seed in zip(hood, combo, strict=True):
                mask = prg_mask(seed, layout.size, m)
                total = total - mask if victim < u else total + mask
            total &= np.uint32(m - 1)
            out.append(layout.unflatten(dequantize_sum(total, 1, clip, levels)))
    return out


def judge(
    report: Report, fed: Federation, seen: Seen, value: Mapping[str, np.ndarray], how: str
) -> None:
    """Record a breach when ``value`` is the input sum of a set smaller than a member allows
    (on the DP stack: of the noised inputs), or, on the DP stack, the sum of any set's
    un-noised (clipped) inputs."""
    report.recoveries_tried += 1
    got = value.get("delta/w")
    if got is None or got.shape != (SIZE,) or not np.all(np.isfinite(got)):
        return
    clients = sorted(seen.accepted)
    for size in range(1, len(clients) + 1):
        for group in itertools.combinations(clients, size):
            need = max(seen.accepted[v] for v in group)
            if size < need:
                want = sum(fed.truth(v) for v in group)
                if np.max(np.abs(got - want)) <= TOLERANCE:
                    report.breaches.append(f"{how}: recovered the input sum of {group} (< {need})")
            if fed.stack == STACK_DP and all(v in fed.released for v in group):
                clean = sum(fed.released[v].clipped["delta/w"].astype(np.float64) for v in group)
                if np.max(np.abs(got - clean)) <= TOLERANCE:
                    report.breaches.append(f"{how}: recovered the un-noised sum of {group}")


def check_noise(report: Report, fed: Federation, node: int, verified: int, how: str) -> None:
    """On the DP stack, a client that accepted a collect must have noised its input at its
    policy's floor: std sqrt(m) >= min-noise C, C <= max-clip, its input's norm <= C."""
    if fed.stack != STACK_DP:
        return
    release = fed.released.get(node)
    report.outcomes["dp noise checked"] += 1
    if release is None:
        report.breaches.append(f"{how}: node {node} accepted a round and added no DP noise")
        return
    norm = float(np.linalg.norm(release.clipped["delta/w"].astype(np.float64)))
    z = release.std * math.sqrt(verified) / release.clip
    if not (z >= MIN_NOISE and release.clip <= MAX_CLIP and norm <= release.clip * (1 + 1e-5)):
        report.breaches.append(
            f"{how}: node {node} released noise std {release.std} at clip {release.clip} "
            f"(norm {norm:.4g}, {verified} verified: z {z:.4g} < min-noise {MIN_NOISE})"
        )


def oracle(report: Report, fed: Federation, seen: Seen, how: str) -> None:
    """Record a breach when a reply carries a client's private value in clear."""
    # each as a reply would print it: repr, or 4 decimals (never a bare integer like "2",
    # which .6g makes of 2.000004 and which any id or hex string contains)
    losses = fed.losses.values()
    firsts = [float(x["delta/w"][0]) for x in fed.inputs.values()]
    secrets = {f"{v:.4f}" for v in [*losses, *firsts]} | {repr(v) for v in losses}
    for msg in seen.replies:
        texts = [str(msg.error.reason)] if msg.has_error() else []
        if msg.has_content():
            for record in msg.content.values():
                if isinstance(record, ConfigRecord | MetricRecord):
                    texts += [str(v) for v in record.values()]
        for text in texts:
            if any(s in text for s in secrets):
                report.breaches.append(
                    f"{how}: a reply carried a private value in clear: {text[:80]}"
                )


# ---------------------------------------------------------------------- rounds
def run_session(
    report: Report,
    rng: random.Random,
    root: Path,
    budget: int,
    classes: tuple[str, ...] = (*COLLECT_CLASSES, *UNMASK_CLASSES, "cohort-difference"),
    stacks: tuple[str, ...] = STACKS,
) -> int:
    """One key session of a few rounds on a fresh federation of one client stack (drawn from
    ``stacks``); return the deviations spent."""
    n = rng.randrange(3, 6)
    fed = Federation(root, n, rng, rng.choice(stacks))
    cfg = SecAggConfig(
        num_shares=rng.randrange(3, n + 1), reconstruction_threshold=rng.choice([0.51, 0.75, 1.0])
    )
    book = KeyBook()
    model = ArrayRecord({"w": Array(np.arange(4, dtype=np.float32))})
    past: list[RecordDict] = []
    sums: list[tuple[dict[str, np.ndarray], set[int], Seen]] = []
    spent = 0
    for _ in range(ROUNDS_PER_SESSION):
        if spent >= budget:
            break
        fed.fresh_inputs()
        kind = rng.choice(classes)
        if rng.random() < 0.5:  # every client but one victim: the classic per-client deviation
            targets = [u for u in fed.nodes if u != rng.choice(fed.nodes)]
        else:
            targets = rng.sample(fed.nodes, rng.randrange(1, n + 1))
        cohort = fed.nodes if kind != "cohort-difference" else rng.sample(fed.nodes, n - 1)
        try:
            server = SecAggServerEngine(cfg, cohort, "masked", keys=book)
        except SecAggRoundFailed:
            continue
        seen = Seen()
        try:
            adverts = {u: fed.ask(u, r) for u, r in server.advertise_requests().items()}
            seen.replies += adverts.values()
            server.receive_public_keys(
                {u: m.content for u, m in adverts.items() if not m.has_error()}
            )
            requests = server.collect_requests()
        except SecAggRoundFailed:
            report.outcomes["round failed"] += 1
            continue
        replies = {}
        for u, req in requests.items():
            req[keys.REC_GLOBAL] = model
            req[keys.REC_CONFIG] = fed.honest_config()
            run_id = 1
            if u in targets and kind in COLLECT_CLASSES:
                run_id = deviate_collect(kind, rng, fed, u, req, past)
            if kind == "order" and u in targets:  # an unmask before this round's collect
                early = RecordDict(
                    {
                        wire.SECAGG_RECORD: ConfigRecord(
                            {
                                wire.KEY_STAGE: wire.STAGE_UNMASK,
                                wire.KEY_SESSION: book.session,
                                wire.KEY_ROUND: server.round_id,
                            }
                        )
                    }
                )
                seen.replies.append(fed.ask(u, early))
            seen.sent[u] = req[wire.SECAGG_RECORD]  # type: ignore[assignment]
            msg = fed.ask(u, req, run_id)
            seen.replies.append(msg)
            if msg.has_error():
                report.outcomes["collect refused"] += 1
                continue
            replies[u] = msg.content
            state = fed.contexts[u].state.config_records[wire.SECAGG_STATE_RECORD]
            if state.get("round") == str(req[wire.SECAGG_RECORD][wire.KEY_ROUND]):  # type: ignore[index]
                seen.accepted[u] = verified_contributors(req[wire.SECAGG_RECORD])  # type: ignore[arg-type]
                check_noise(report, fed, u, seen.accepted[u], kind)
            masked = msg.content.array_records.get(
                str(req[wire.SECAGG_RECORD][wire.KEY_MASKED_RECORD])
            )  # type: ignore[index]
            if masked is not None:
                seen.masked[u] = {k: a.numpy() for k, a in masked.items()}
        past += [requests[u] for u in list(requests)[:1]]
        report.deviations[kind] += 1
        report.stacks[fed.stack] += 1
        spent += 1
        summed = None
        try:
            server.receive_masked_inputs(replies)
            while summed is None:
                requests = server.unmask_requests()
                for u, req in requests.items():
                    if u in targets and kind in UNMASK_CLASSES[:2]:
                        deviate_unmask(kind, rng, fed, u, req)
                    msg = fed.ask(u, req)
                    seen.replies.append(msg)
                    if kind == "order" and u in targets:  # a second unmask of the same round
                        seen.replies.append(fed.ask(u, req))
                    if msg.has_error():
                        report.outcomes["unmask refused"] += 1
                        continue
                    urec = msg.content[wire.SECAGG_RECORD]
                    owners = wire.unpack_ids(wire.get_bytes(urec, wire.KEY_SHARE_OWNERS))  # type: ignore[arg-type]
                    for o, s in zip(
                        owners, wire.get_bytes_list(urec, wire.KEY_SHARES), strict=True
                    ):  # type: ignore[arg-type]
                        seen.shares.setdefault(o, []).append(s)
                    peers = wire.unpack_ids(wire.get_bytes(urec, wire.KEY_SEED_PEERS))  # type: ignore[arg-type]
                    for p, s in zip(peers, wire.get_bytes_list(urec, wire.KEY_SEEDS), strict=True):  # type: ignore[arg-type]
                        seen.seeds[(u, p)] = s
                ok = _ok(seen.replies, requests)
                summed = server.receive_unmask_shares({u: r.content for u, r in ok})
        except SecAggRoundFailed:
            report.outcomes["round failed"] += 1
        if summed is not None:
            report.outcomes["sum returned"] += 1
            judge(report, fed, seen, summed, f"{kind}: the server's sum")
            for old, _, _ in sums:
                diff = {k: summed[k] - old[k] for k in summed if k in old}
                judge(report, fed, seen, diff, f"{kind}: a difference of two sums")
            sums.append((summed, set(server.contributors), seen))
        for victim in fed.nodes:
            for value in solve(seen, victim):
                judge(report, fed, seen, value, f"{kind}: solved for node {victim}")
        oracle(report, fed, seen, kind)
    return spent


def _ok(replies: list[Message], requests: Mapping[int, RecordDict]) -> list[tuple[int, Message]]:
    """The last successful reply of each node asked in this unmask exchange."""
    out: dict[int, Message] = {}
    for msg in replies:
        if not msg.has_error() and msg.metadata.src_node_id in requests:
            rec = msg.content.config_records.get(wire.SECAGG_RECORD)
            if rec is not None and rec.get(wire.KEY_STAGE) == wire.STAGE_UNMASK:
                out[msg.metadata.src_node_id] = msg
    return sorted(out.items())


# ---------------------------------------------------------------------- policy classes
def dp_numbers(report: Report, rng: random.Random, root: Path) -> None:
    """A train message with random DP and SecAgg+ numbers: if a strict node accepts it, the
    noise it will add is at least its policy's floor (counting only contributors it can verify)."""
    report.deviations["dp-numbers"] += 1
    policy = PrivacyPolicy(require_secagg=True, require_dp=True, min_noise=1.0, max_clip=1.0)
    n = rng.randrange(1, 8)
    t = rng.randrange(0, n + 2)
    config: dict[str, Any] = {
        KEY_DP_CLIP: rng.choice([1.0, 0.5, 1e-30, 2.0, math.nan, -1.0, "1.0", 0.0]),
        KEY_DP_NOISE_STD: rng.choice([1.0, 0.7, 0.1, 0.0, -0.0, math.inf, 1e-300, "0.9"]),
    }
    if rng.random() < 0.5:
        config[KEY_DP_MIN_CLIENTS] = rng.choice([1, 10, 1e12, math.nan])
    secagg = ConfigRecord(
        {
            wire.KEY_STAGE: wire.STAGE_COLLECT,
            wire.KEY_NEIGHBOURS: wire.pack_ids(list(range(2, 2 + n))),
            wire.KEY_THRESHOLD: rng.choice([t, float(t), math.nan, -t]),
        }
    )
    content = RecordDict({keys.REC_CONFIG: ConfigRecord(config), wire.SECAGG_RECORD: secagg})
    msg = Message(content, dst_node_id=5, message_type=MessageType.TRAIN)
    ctx = Context(
        run_id=1,
        node_id=5,
        node_config={NODE_STATE_DIR_KEY: str(root)},
        state=RecordDict(),
        run_config={},
    )
    try:
        check_train(policy, msg, ctx)
    except (PolicyRefusal, ValueError):
        report.outcomes["dp message refused"] += 1
        return
    report.outcomes["dp message accepted"] += 1
    clip, std = float(str(config[KEY_DP_CLIP])), float(str(config[KEY_DP_NOISE_STD]))
    z = std * math.sqrt(verified_contributors(secagg)) / clip
    if not (z >= policy.min_noise and clip <= policy.max_clip):
        report.breaches.append(f"dp-numbers: accepted noise multiplier {z} clip {clip} ({config})")


def model_encoding(report: Report, rng: random.Random, root: Path) -> None:
    """The same global model re-encoded (dtype, byte order, -0.0, NaN payload, key order, an
    extra config record): once-per-model must refuse the second training on it."""
    report.deviations["model-encoding"] += 1
    policy = PrivacyPolicy(once_per_model=True)
    ledger_dir = root / f"opm-{rng.randrange(2**32)}"
    w = np.array([0.0, 1.5, -2.25, np.nan], np.float32)

    def message(arr: np.ndarray, extra: bool, order: bool) -> tuple[Message, Context]:
        records = {"b": Array(np.ones(2, np.float32)), "a": Array(arr)}
        names = sorted(records, reverse=order)
        content = RecordDict({keys.REC_GLOBAL: ArrayRecord({k: records[k] for k in names})})
        content[keys.REC_CONFIG] = ConfigRecord({"lr": rng.random()})
        if extra:
            content["note"] = ConfigRecord({"x": 1})
        ctx = Context(
            run_id=1,
            node_id=5,
            node_config={NODE_STATE_DIR_KEY: str(ledger_dir)},
            state=RecordDict(),
            run_config={},
        )
        return Message(content, dst_node_id=5, message_type=MessageType.TRAIN), ctx

    check_train(policy, *message(w, False, False))
    variants: list[Callable[[np.ndarray], np.ndarray]] = [
        lambda a: a.astype(np.float64),
        lambda a: a.astype(">f4"),
        lambda a: np.where(a == 0, -0.0, a).astype(np.float32),
        lambda a: np.where(np.isnan(a), -np.nan, a).astype(np.float32),
        lambda a: a,
    ]
    arr = rng.choice(variants)(w)
    try:
        check_train(policy, *message(arr, rng.random() < 0.5, rng.random() < 0.5))
    except (PolicyRefusal, ValueError):
        report.outcomes["re-encoded model refused"] += 1
        return
    report.breaches.append(f"model-encoding: a re-encoded model trained twice ({arr.dtype})")


# ---------------------------------------------------------------------- entry point
def run(
    deviations: int,
    seed: int = 0,
    classes: tuple[str, ...] = CLASSES,
    stacks: tuple[str, ...] = STACKS,
) -> Report:
    """Run at least ``deviations`` seeded deviations of ``classes``, each key session on a
    client stack drawn from ``stacks`` (the deviations split between them); return what
    happened.

    State files go to a RAM disk where there is one (the clients fsync their pins)."""
    report = Report()
    rng = random.Random(seed)
    round_classes = tuple(c for c in classes if c not in POLICY_CLASSES)
    policy_classes = tuple(c for c in classes if c in POLICY_CLASSES)
    ram = "/dev/shm" if Path("/dev/shm").is_dir() else None
    quiet = [logging.getLogger(name) for name in _NOISY]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)  # every refused message is logged: thousands of lines
    try:
        with (
            server_identity(),
            released_by_clients(),
            tempfile.TemporaryDirectory(dir=ram) as tmp,
        ):
            _run(report, rng, Path(tmp), deviations, round_classes, policy_classes, stacks)
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return report


_NOISY = (
    "fedge.server.secagg.engine",
    "fedge.clients.secagg.mod",
    "fedge.clients.mods",
    "fedge.clients.privacy.replies",
)


def _run(
    report: Report,
    rng: random.Random,
    tmp: Path,
    deviations: int,
    round_classes: tuple[str, ...],
    policy_classes: tuple[str, ...],
    stacks: tuple[str, ...],
) -> None:
    """Sessions of rounds (and batches of policy checks) until ``deviations`` are spent."""
    session = 0
    while report.total < deviations:
        root = tmp / f"s{session}"
        root.mkdir()
        session += 1
        if policy_classes and (not round_classes or rng.random() < 0.15):
            for _ in range(5):
                kind = rng.choice(policy_classes)
                (dp_numbers if kind == "dp-numbers" else model_encoding)(report, rng, root)
            continue
        run_session(report, rng, root, deviations - report.total, round_classes, stacks)
