"""The SecAgg+ Flower client mod: answers protocol stages and masks the train contribution."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge import keys
from fedge.clients.privacy.ledger import ledger_root
from fedge.clients.privacy.policy import node_policy
from fedge.clients.privacy.replies import (
    FIXED_FAILURE,
    LOCAL_METRICS,
    PUBLIC_METRICS,
    dp_requested,
    warn_once,
)
from fedge.clients.secagg.engine import ClientRules, SecAggClientEngine, SecAggProtocolError
from fedge.clients.secagg.pins import PinStore
from fedge.privacy.wire import KEY_DP_NOISE_STD, MET_DPSGD_EPSILON
from fedge.secagg import identity as ident
from fedge.secagg import wire
from fedge.secagg.vectors import scale_for
from fedge.strategies.registry import robust_config
from fedge.strategies.robust import clip_contribution

# A trust list for nodes whose policy names none: node config key, else this variable
# (``fedge simulate`` writes one for the nodes it simulates and sets it).
NODE_TRUST_KEY = "secagg-trusted-keys"
TRUST_ENV = "FEDGE_SECAGG_TRUSTED_KEYS"
_NOTICED: set[tuple[int, int]] = set()  # (run, node) pairs whose no-trust-list notice was logged

# Error code of a refused SecAgg+ message (Flower reserves the small codes).
ERROR_SECAGG = 640
# Per-client metrics travel summed inside the masked vector: every numeric metric of the train
# reply (a user's own included) but fedge's per-node diagnostics (LOCAL_METRICS); under DP only
# the public ones (a sum of losses carries none of the DP noise). Kept for callers that list them.
MASKED_METRICS = (
    keys.MET_TRAIN_LOSS,
    keys.MET_NUM_EXAMPLES,
    keys.MET_LOCAL_STEPS,
    keys.MET_COMPLETED,
    keys.MET_TRAIN_SECONDS,
    MET_DPSGD_EPSILON,
)
NON_FINITE = (
    "the contribution holds a non-finite value (rule: every value of a contribution is "
    "finite); this node sends nothing this round"
)
log = logging.getLogger(__name__)


def secaggplus_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Run the SecAgg+ stage a message carries; pass every other message through untouched.

    In the collect stage the mod trains through ``call_next``, clips the contribution's
    weight and update to the run's ``max-client-weight`` / ``max-update-norm`` (the server
    checks only their sum), clips every value into the quantizer's range (never refuses
    one: a value-dependent refusal is an oracle), then replaces the reply by the masked
    form of its ``contribution`` with the reply's numeric metrics folded into the same
    masked vector (:func:`_metric_arrays`), so neither the plain contribution nor any
    client's own metrics leave the client. Under DP only the public ones and the loss the DP
    mechanism noised and accounted (``dp-train-loss``) are summed: a sum of clear losses
    would carry no noise. A refused stage becomes an error reply naming the rule
    (never a count or value of the node's data); the server counts that node as dropped. The server half is ``fedge.server.secagg.aggregator``.
    """
    if not msg.has_content() or wire.SECAGG_RECORD not in msg.content.config_records:
        return call_next(msg, context)
    states = context.state.config_records
    if wire.SECAGG_STATE_RECORD not in states:
        states[wire.SECAGG_STATE_RECORD] = ConfigRecord()
    rec = msg.content.config_records[wire.SECAGG_RECORD]
    try:
        key, rules = node_identity(context), node_rules(context)
    except ValueError as exc:
        return Message(Error(code=ERROR_SECAGG, reason=f"SecAgg+: {exc}"), reply_to=msg)
    engine = SecAggClientEngine(
        msg.metadata.dst_node_id, states[wire.SECAGG_STATE_RECORD], key, rules, node_pins(context)
    )

    def contribute() -> dict[str, np.ndarray]:
        try:
            reply = call_next(msg, context)
        except Exception as exc:  # the cause stays here: its text could carry data
            log.error("SecAgg+: local training raised (kept on this node): %r", exc)
            raise SecAggProtocolError(FIXED_FAILURE) from None
        if reply.has_error():  # fedge's own refusals below name a rule, never data
            raise SecAggProtocolError(f"local training failed: {reply.error.reason}")
        record = reply.content.array_records.get(keys.REC_CONTRIB)
        if record is None:
            raise SecAggProtocolError(f"the train reply has no {keys.REC_CONTRIB!r} record to mask")
        arrays = {k: a.numpy() for k, a in record.items()}
        config = msg.content.config_records.get(keys.REC_CONFIG, ConfigRecord())
        if KEY_DP_NOISE_STD in config:  # only the public and the DP-noised metrics are summed
            return {  # (the update clipped to C before its noise; the loss noised by its mod)
                **_clip_to_range(arrays, rec),
                **_metric_arrays(reply.content, rec, True),
            }
        arrays = clip_contribution(arrays, robust_config(dict(config)))  # type: ignore[arg-type]
        dp = dp_requested(config)
        return {**_clip_to_range(arrays, rec), **_metric_arrays(reply.content, rec, dp)}

    try:
        out = engine.handle(msg.content, contribute, msg.metadata.run_id)
    except (SecAggProtocolError, ValueError) as exc:
        return Message(Error(code=ERROR_SECAGG, reason=f"SecAgg+: {exc}"), reply_to=msg)
    if rules.trusted is None:  # no promise against an active server: say so, every reply
        out.config_records[wire.SECAGG_RECORD][wire.KEY_NOTICE] = wire.NOTICE_NO_TRUST_LIST
        if (msg.metadata.run_id, context.node_id) not in _NOTICED:  # and once per run in the log
            _NOTICED.add((msg.metadata.run_id, context.node_id))
            log.warning("SecAgg+ node %d: %s", context.node_id, wire.NOTICE_NO_TRUST_LIST)
    return Message(out, reply_to=msg)


def identity_path(context: Context) -> Path:
    """Where this node's SecAgg+ signing key lives: under its state dir, per partition."""
    return _state_file(context, "secagg-identity", "key")


def write_trust_list(root: Path, partitions: range, path: Path) -> Path:
    """Create (or keep) the identity keys of ``partitions`` under state dir ``root`` and write
    their public halves to the trust list ``path``: what an operator of every node does, and
    what ``fedge simulate`` does for the nodes it simulates."""
    public = [
        ident.public_bytes(_load_identity(root / "secagg-identity" / f"partition-{p:05d}.key"))
        for p in partitions
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ident.format_trust_list(public))
    return path


def node_pins(context: Context) -> PinStore:
    """This node's identity pins: beside its ledger, per partition, across runs."""
    return PinStore(_state_file(context, "secagg-pins", "json"))


def _state_file(context: Context, kind: str, suffix: str) -> Path:
    pid = int(str(context.node_config.get(keys.NODE_PARTITION_ID, context.node_id)))
    root = ledger_root(context.node_config, context.run_config)
    return root / kind / f"partition-{pid:05d}.{suffix}"


def node_identity(context: Context) -> Ed25519PrivateKey:
    """This node's long-term signing key, read once per process (created on first use)."""
    return _load_identity(identity_path(context))


@functools.lru_cache(maxsize=64)
def _load_identity(path: Path) -> Ed25519PrivateKey:
    return ident.load_or_create(path)


def node_rules(context: Context) -> ClientRules:
    """The SecAgg+ rules of this node's privacy policy (minimum neighbourhood, trust list)."""
    policy = node_policy(context.node_config)
    keys_file = policy.trusted_keys or trust_list_path(context.node_config)
    trusted = (
        _parsed_trust_list(keys_file, ident.read_trust_list(Path(keys_file))) if keys_file else None
    )
    return ClientRules(
        min_neighbours=policy.secagg_min_neighbours,
        min_threshold=policy.secagg_min_threshold,
        trusted=trusted,
    )


def trust_list_path(node_config: Mapping[str, object]) -> str:
    """The trust list a node without one in its policy uses: node config, else environment."""
    return str(node_config.get(NODE_TRUST_KEY, "") or os.environ.get(TRUST_ENV, ""))


@functools.lru_cache(maxsize=64)
def _parsed_trust_list(path: str, text: str) -> frozenset[bytes]:
    """The trust list ``text`` parsed once per distinct content (read for every message, so
    an edited list applies at once; parsed, hex-decoded and checked only when it changed)."""
    return ident.parse_trust_list(text, path)


def _metric_arrays(content: RecordDict, rec: ConfigRecord, dp: bool) -> dict[str, np.ndarray]:
    """The reply's summable metrics as (1,) arrays, clipped into the quantizer's range.

    Every numeric metric the reply carries is summed, a user's own included, except
    fedge's per-node diagnostics (:data:`LOCAL_METRICS`, meaningless as a sum); under DP
    only the public ones (:data:`PUBLIC_METRICS`: a sum of losses carries no DP noise), the
    others named once in the node's log. Every client of a round runs the same app and
    config, so they all carry the same ones; a client that differs has a different layout
    and is dropped, never mis-summed. A value beyond +-(clipping range x its scale) is
    clipped (its sum is then a bound, named once in the node's log), never refused.
    """
    metrics = content.metric_records.get(keys.REC_METRICS, MetricRecord())
    clip = wire.get_number(rec, wire.KEY_CLIPPING_RANGE)
    scales = wire.get_scales(rec)
    kept = [
        name
        for name, value in metrics.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and name not in LOCAL_METRICS
        and (not dp or name in PUBLIC_METRICS)
    ]
    if dp:
        warn_once(
            "SecAgg+ with DP: these train metrics depend on this node's data and stay on it",
            [k for k in metrics if k not in LOCAL_METRICS and k not in kept],
        )
    out, clipped = {}, []
    for name in sorted(kept):
        value = float(metrics[name])  # type: ignore[arg-type]
        key = wire.PREFIX_METRIC + name
        bound = clip * scale_for(key, scales)
        if np.isfinite(value) and abs(value) > bound:
            clipped.append(name)
        clamped = min(bound, max(-bound, value)) if np.isfinite(value) else 0.0
        out[key] = np.array([clamped], dtype=np.float32)
    warn_once("SecAgg+: these metrics were clipped into the quantizer's range", clipped)
    return out


def _clip_to_range(arrays: dict[str, np.ndarray], rec: ConfigRecord) -> dict[str, np.ndarray]:
    """Clip every value into the quantizer's range (clipping range x the key's scale).

    Clipped by the client, not refused: a refusal that depends on a value is an oracle (on
    main, 30 refusals bisected a client's max |delta| to 9 digits). A clipped sum is a
    bound on the true one, as the client's norm clip already makes it; the node's log
    names the keys it clipped. A non-finite value is refused with a fixed reason.
    """
    clip = wire.get_number(rec, wire.KEY_CLIPPING_RANGE)
    scales = wire.get_scales(rec)
    out, clipped = {}, []
    for name, arr in arrays.items():
        if arr.size and not np.all(np.isfinite(arr)):
            raise SecAggProtocolError(NON_FINITE)
        bound = np.float32(clip * scale_for(name, scales))
        if arr.size and float(np.max(np.abs(arr))) > bound:
            clipped.append(name)
            arr = np.clip(arr, -bound, bound).astype(arr.dtype)
        out[name] = arr
    warn_once("SecAgg+: these contribution keys were clipped into the quantizer's range", clipped)
    return out
