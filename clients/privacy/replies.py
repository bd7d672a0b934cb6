"""What a reply may say in clear: no metric and no refusal text that depends on the node's data.

A reply is an oracle when anything in it in clear varies with the node's data beyond what
its privacy mechanism accounts for: DP-SGD's training loss (lower for a client holding a
canary, at any epsilon), a count in a refusal ("a stream of 680 tokens gives 0 records"),
a refusal that depends on a value (a range check a server bisects). So wherever privacy
is in play (:func:`private_train`: the node's policy promises SecAgg+ or DP, or the message
asks for DP-SGD or distributed DP):

* a train reply's clear metrics keep only :data:`PUBLIC_METRICS`, numbers fixed by the
  config or the accountant (:func:`public_metrics`); the rest stay on the node, named once
  per process in its log. Under SecAgg+ the metrics travel inside the masked sum instead
  (``fedge.clients.secagg.mod``), and under DP only the public ones do: the loss goes as
  ``dp-train-loss``, noised by the DP mechanism and counted in the node's ledger
  (``fedge.clients.privacy.dpsgd``, ``fedge.clients.privacy.mods``), never in clear;
* an exception while training becomes :data:`ERROR_TRAINING` with a fixed reason
  (:func:`fixed_failure`); the node's log keeps the cause. Every refusal the client
  writes itself (policy, SecAgg+, DP, budget) names its rule only, never a count or value.

An evaluate reply in a DP run (a DP-SGD or distributed-DP run, even on a node without a
policy) keeps only the public metrics too (:func:`public_evaluate_reply`): its held-out loss
is outside every DP accounting, so it stays on the node, said once in its log. A run is a DP
run for the node when the evaluate message asks for DP or when the node was asked for DP in
an earlier message of the run (:func:`remember_dp_run`, kept in the
node's run state): a server cannot get the loss back by leaving the marker off.

A node without a policy file promises nothing, and says so (:func:`announce_promise`):
once per run in its log, and in every train and evaluate reply as the ConfigRecord
:data:`PROMISE_RECORD` (``promise`` = ``"none"`` or the rules it holds).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, MetricRecord

from fedge import keys
from fedge.clients.privacy.policy import PrivacyPolicy
from fedge.privacy.wire import (
    KEY_DP_NOISE_STD,
    KEY_DPSGD_NOISE,
    MET_DP_TRAIN_LOSS,
    MET_DPSGD_EPSILON,
)

log = logging.getLogger(__name__)

ERROR_TRAINING = 644  # error code of a train or evaluate call that raised under privacy
FIXED_FAILURE = (
    "local training failed on this node; under its privacy policy the cause stays in its own "
    "log (a reason could carry counts or values of its data)"
)
PROMISE_RECORD = "fedge.privacy"  # ConfigRecord of every train/evaluate reply: what it promises
DP_RUN_RECORD = "fedge.dp-run"  # ConfigRecord in the node's run state: DP was asked in this run
KEY_PROMISE = "promise"
# Metrics a private reply keeps in clear: fixed by the config (steps, completed fraction), the
# node's public partition id, the accountant's epsilon (a function of public DP parameters and
# the sampling rate), the training loss as a DP mechanism released it (noised, and counted in
# the node's ledger: DP-SGD's loss sums, distributed DP's loss release), and process counters
# that do not read the data.
PUBLIC_METRICS = frozenset(
    {
        keys.MET_LOCAL_STEPS,
        keys.MET_COMPLETED,
        keys.MET_PARTITION,
        keys.MET_MODEL_LOADS,
        keys.MET_CALLS,
        MET_DPSGD_EPSILON,
        MET_DP_TRAIN_LOSS,
    }
)
# fedge's own per-node diagnostics: they stay home under SecAgg+ (a sum of them means nothing).
LOCAL_METRICS = frozenset(
    {
        keys.MET_PARTITION,
        keys.MET_MODEL_LOADS,
        keys.MET_CALLS,
        "client-seconds",
        "dp-sgd-sample-rate",
        "dp-sgd-records",
    }
)
_warned: set[str] = set()
_announced: set[int] = set()


def dp_requested(config: Mapping[str, object] | None) -> bool:
    """Whether the message asks this node for DP-SGD or distributed DP."""
    if config is None:
        return False
    try:
        sgd = float(str(config.get(KEY_DPSGD_NOISE, 0.0))) > 0
    except ValueError:
        sgd = True  # a malformed number is refused elsewhere; treat it as private here
    return sgd or KEY_DP_NOISE_STD in config


def message_config(msg: Message) -> ConfigRecord | None:
    """The message's fedge config record, if any."""
    return msg.content.config_records.get(keys.REC_CONFIG) if msg.has_content() else None


def private_train(policy: PrivacyPolicy, msg: Message) -> bool:
    """Whether privacy is in play for this message: a strict policy, or DP asked for."""
    return policy.strict or dp_requested(message_config(msg))


def remember_dp_run(msg: Message, context: Context) -> None:
    """Note in the node's run state that this run asked for DP (its later evaluates stay private)."""
    if dp_requested(message_config(msg)):
        context.state[DP_RUN_RECORD] = ConfigRecord({"asked": True})


def dp_run(context: Context) -> bool:
    """Whether an earlier message of this run asked this node for DP."""
    return DP_RUN_RECORD in context.state.config_records


def warn_once(what: str, names: list[str]) -> None:
    """One log line per distinct (what, names) per process."""
    key = f"{what}: {', '.join(sorted(names))}"
    if names and key not in _warned:
        _warned.add(key)
        log.warning("%s", key)


def public_metrics(metrics: MetricRecord) -> MetricRecord:
    """The metrics a private reply keeps in clear; the rest are named once in the node's log."""
    dropped = sorted(k for k in metrics if k not in PUBLIC_METRICS)
    warn_once(
        "privacy: these train metrics depend on this node's data and stay on it (its policy "
        "or the message's DP allows no metric in clear)",
        dropped,
    )
    return MetricRecord({k: v for k, v in metrics.items() if k in PUBLIC_METRICS})


def public_reply(reply: Message) -> Message:
    """A private train reply with its clear metrics cut to :data:`PUBLIC_METRICS`."""
    if reply.has_error() or not reply.has_content():
        return reply
    for name in list(reply.content.metric_records):
        reply.content[name] = public_metrics(reply.content.metric_records[name])
    return reply


def public_evaluate_reply(reply: Message) -> Message:
    """An evaluate reply under DP cut to :data:`PUBLIC_METRICS`: the held-out loss and example
    count stay on the node (no mechanism noises or accounts them), said once in its log."""
    if reply.has_error() or not reply.has_content():
        return reply
    for name in list(reply.content.metric_records):
        metrics = reply.content.metric_records[name]
        warn_once(
            "privacy: the run asks for DP, and an evaluate reply's held-out loss is outside its "
            "accounting: these evaluate metrics stay on this node (evaluate on the server: "
            "client-eval = false)",
            [k for k in metrics if k not in PUBLIC_METRICS],
        )
        reply.content[name] = MetricRecord(
            {k: v for k, v in metrics.items() if k in PUBLIC_METRICS}
        )
    return reply


def fixed_failure(msg: Message, exc: BaseException) -> Message:
    """The reply to a call that raised under privacy: a fixed code and reason; the cause is
    logged here, on the node."""
    log.error("local %s failed (kept on this node): %r", msg.metadata.message_type, exc)
    return Message(Error(code=ERROR_TRAINING, reason=FIXED_FAILURE), reply_to=msg)


def announce_promise(policy: PrivacyPolicy, msg: Message, reply: Message) -> Message:
    """Say what this node promises: a log line once per run when it promises nothing, and
    the :data:`PROMISE_RECORD` in every train and evaluate reply with content."""
    kind = msg.metadata.message_type.split(".")[0]
    if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
        return reply
    promise = policy.promise()
    if promise == "none" and msg.metadata.run_id not in _announced:
        _announced.add(msg.metadata.run_id)
        log.warning(
            "privacy: this node has no privacy policy (node config 'privacy-policy' or "
            "FEDGE_PRIVACY_POLICY): it promises nothing, answers plain train and evaluate "
            "messages, and its replies show the server its update and metrics. Write one with "
            "the strict preset (docs/privacy.md)"
        )
    if reply.has_content() and not reply.has_error():
        reply.content[PROMISE_RECORD] = ConfigRecord({KEY_PROMISE: promise})
    return reply
