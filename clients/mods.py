"""The ClientApp's one app-level mod: this node's privacy policy, then mods from a fixed registry.

``ClientApp(mods=[...])`` is fixed at import time, but which mods a run wants
(SecAgg+, distributed-DP clipping and noise, fault injection) is configuration, so
the ClientApp installs :func:`dispatch_mods` only. On every call it

1. checks train and evaluate messages against this node's :class:`fedge.clients.privacy.policy.PrivacyPolicy`
   and answers a violation with an error reply naming the rule (the server reports it);
2. applies the mods ``client-mods`` names (message config, else run config), outermost
   first, each looked up in :data:`REGISTRY`, plus any the policy requires.

No module path from a message is ever imported: a name outside the registry is
refused with an error reply listing the registered names. The old dotted names of
the registered mods are accepted as aliases (a string lookup, never an import).

Contract for mods: a mod that handles a message itself (e.g. a SecAgg+ key-setup
stage, recognised by its own ConfigRecord key) returns a reply without calling
``call_next``; a mod that post-processes the ``contribution`` ArrayRecord of a train
reply must keep its keys, shapes and float32 dtype (see :mod:`fedge.keys`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import Context, Error, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedge import keys
from fedge.clients.faults import fault_mod
from fedge.clients.privacy.ledger import ModelAlreadyUsed
from fedge.clients.privacy.mods import distributed_dp_mod
from fedge.clients.privacy.policy import (
    ERROR_POLICY,
    PolicyRefusal,
    check_evaluate,
    check_train,
    node_policy,
)
from fedge.clients.privacy.replies import (
    announce_promise,
    dp_run,
    fixed_failure,
    private_train,
    public_evaluate_reply,
    public_reply,
    remember_dp_run,
)
from fedge.clients.secagg.mod import secaggplus_mod
from fedge.privacy.wire import KEY_DP_NOISE_STD
from fedge.secagg import wire as secagg_wire

log = logging.getLogger(__name__)
UNREADABLE_POLICY = "privacy policy: this node's policy file is unreadable (its log says why)"
UNREADABLE_STATE = "privacy policy: this node's privacy state is unreadable (its log says why)"
MOD_SECAGG = "secagg"
MOD_DISTRIBUTED_DP = "distributed-dp"
MOD_FAULTS = "faults"
REGISTRY: dict[str, Mod] = {
    MOD_SECAGG: secaggplus_mod,
    MOD_DISTRIBUTED_DP: distributed_dp_mod,
    MOD_FAULTS: fault_mod,
}
# Dotted names earlier configs used; looked up as strings, never imported.
ALIASES = {
    "fedge.clients.secagg.mod:secaggplus_mod": MOD_SECAGG,
    "fedge.clients.privacy.mods:distributed_dp_mod": MOD_DISTRIBUTED_DP,
    "fedge.clients.faults:fault_mod": MOD_FAULTS,
}


def configured_mods(msg: Message, context: Context) -> list[str]:
    """Registry names of the mods ``client-mods`` asks for; anything else is refused."""
    raw: object = ""
    if msg.has_content() and keys.REC_CONFIG in msg.content.config_records:
        raw = msg.content.config_records[keys.REC_CONFIG].get(keys.CFG_CLIENT_MODS, "")
    if not raw:
        raw = context.run_config.get(keys.CFG_CLIENT_MODS, "")
    if not isinstance(raw, str):
        raise PolicyRefusal(f"config key '{keys.CFG_CLIENT_MODS}' must be a string, got {raw!r}")
    names = []
    for item in (p.strip() for p in raw.split(",") if p.strip()):
        name = ALIASES.get(item, item)
        if name not in REGISTRY:
            raise PolicyRefusal(
                f"'{keys.CFG_CLIENT_MODS}' names {item!r}, which is not a registered mod; this "
                f"client never imports a module a message names. Registered: {', '.join(REGISTRY)}"
            )
        names.append(name)
    return names


def required_mods(msg: Message, names: list[str]) -> list[str]:
    """The mods to run: the configured ones, plus those this node's privacy demands.

    A SecAgg+ stage always runs the SecAgg+ mod (outermost) and a train message
    carrying a distributed-DP noise level always runs the noise mod, whatever the
    server listed: otherwise a server could ask for DP and then skip the client's noise.
    """
    out = list(names)
    config = msg.content.config_records.get(keys.REC_CONFIG) if msg.has_content() else None
    if msg.has_content() and secagg_wire.SECAGG_RECORD in msg.content.config_records:
        out = [MOD_SECAGG, *(n for n in out if n != MOD_SECAGG)]
    if config is not None and KEY_DP_NOISE_STD in config and MOD_DISTRIBUTED_DP not in out:
        out.append(MOD_DISTRIBUTED_DP)
    return out


def dispatch_mods(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Check the node's privacy policy, then apply the registered mods around ``call_next``.

    Where privacy is in play (:func:`fedge.clients.privacy.replies.private_train`) the reply
    says nothing that depends on the node's data: clear metrics cut to the public ones, an
    exception a fixed code and reason. Every train and evaluate reply says what the node
    promises (:func:`fedge.clients.privacy.replies.announce_promise`).
    """
    kind = msg.metadata.message_type.split(".")[0]
    try:
        policy = node_policy(context.node_config)
    except ValueError as exc:  # an unreadable policy file: refuse, promise unknown
        log.error("privacy policy unreadable, message refused: %s", exc)
        return Message(Error(code=ERROR_POLICY, reason=UNREADABLE_POLICY), reply_to=msg)
    try:
        names = required_mods(msg, configured_mods(msg, context))
        if kind == MessageType.TRAIN:
            check_train(policy, msg, context)
        elif kind == MessageType.EVALUATE:
            check_evaluate(policy)
    except (PolicyRefusal, ModelAlreadyUsed) as exc:  # the rule, never data or numbers
        return Message(Error(code=ERROR_POLICY, reason=f"privacy policy: {exc}"), reply_to=msg)
    except ValueError as exc:  # the node's own state (ledger): the cause stays here
        log.error("privacy state unreadable, message refused: %s", exc)
        return Message(Error(code=ERROR_POLICY, reason=UNREADABLE_STATE), reply_to=msg)
    handler: ClientAppCallable = call_next
    for name in reversed(names):
        handler = _wrap(REGISTRY[name], handler)
    if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
        return handler(msg, context)
    private = private_train(policy, msg) or (kind == MessageType.EVALUATE and dp_run(context))
    remember_dp_run(msg, context)
    try:
        reply = handler(msg, context)
    except Exception as exc:
        if not private:
            raise
        return fixed_failure(msg, exc)
    if private and kind == MessageType.TRAIN:
        reply = public_reply(reply)
    elif private and kind == MessageType.EVALUATE:  # DP asked for, no strict policy
        reply = public_evaluate_reply(reply)
    return announce_promise(policy, msg, reply)


def _wrap(mod: Mod, inner: ClientAppCallable) -> Callable[[Message, Context], Message]:
    """Bind ``inner`` as the ``call_next`` of ``mod``."""

    def call(msg: Message, context: Context) -> Message:
        return mod(msg, context, inner)

    return call
