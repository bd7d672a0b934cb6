"""Identities that outlive a run, a client that says when it makes no promise, and where state lives.

Issue 30 item 5: identity pins lived in the run's ``Context.state``. On main (2c7e381, read
from its code: ``check_identities`` kept pins in the engine's state record, which Flower
makes fresh for every run) a new run started with no pins, so a server could pose as a
node the client had pinned in an earlier run with keys and an identity it made itself,
and the new-session attack of ``test_unmasking`` (which recovered the input to 3.3e-6 on
23d54ee within one run) worked again across runs. Now the pins are in a file under the
node's state dir and a new run refuses the substitute. Issue 32 item 6: the state dir was
``$FEDGE_HOME/privacy-ledger`` for every app and run; now it is the node's (node config,
environment, beside its policy) or one per app.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from typer.testing import CliRunner

from fedge import keys
from fedge.cli.main import app as cli
from fedge.clients.privacy.ledger import NODE_STATE_DIR_KEY, STATE_DIR_ENV, ledger_root
from fedge.clients.privacy.policy import POLICY_ENV, PrivacyPolicy
from fedge.clients.secagg.mod import (
    ERROR_SECAGG,
    TRUST_ENV,
    identity_path,
    node_rules,
    secaggplus_mod,
)
from fedge.secagg import identity, wire
from fedge.secagg.config import SecAggConfig
from fedge.secagg.crypto import generate_keypair
from fedge.server.secagg.engine import SecAggServerEngine
from fedge.simulations.runner import node_privacy
from tests.privacy.adversary import attacker as atk

NODES = {11: 0, 12: 1, 13: 2}  # node id -> partition


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages are built as the ServerApp builds them (Flower reads the task identity)."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)


def context(node: int, run: int, root: Path) -> Context:
    """Node ``node``'s Context in run ``run``: a fresh state, as Flower makes per run."""
    config = {keys.NODE_PARTITION_ID: NODES[node], NODE_STATE_DIR_KEY: str(root)}
    return Context(run_id=run, node_id=node, node_config=config, state=RecordDict(), run_config={})


def ask(node: int, ctx: Context, content: RecordDict) -> Message:
    """Deliver ``content`` to ``node`` through the real SecAgg+ mod; train returns a secret."""

    def train(msg: Message, _: Context) -> Message:
        arrays = {**atk.secret_input(node), keys.KEY_WEIGHT: np.ones(1, np.float32)}
        record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        return Message(RecordDict({keys.REC_CONTRIB: record}), reply_to=msg)

    msg = Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
    return secaggplus_mod(msg, ctx, train)


def test_a_new_run_cannot_replace_an_identity_pinned_in_an_earlier_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Run 1: an honest round, every node pins its neighbours. Run 2 (fresh Context.state, a
    new key session): the server poses as the victim's neighbours with keys and identities it
    made. On main the fresh state held no pins and the collect was accepted (see the module
    doc); now the pins on disk refuse it."""
    # Prepare: run 1, honest, without a trust list (trust on first use)
    ctxs = {u: context(u, 1, tmp_path) for u in NODES}
    server = SecAggServerEngine(SecAggConfig(), sorted(NODES), atk.MASKED)
    with caplog.at_level(logging.WARNING):
        adverts = {u: ask(u, ctxs[u], r) for u, r in server.advertise_requests().items()}
        server.receive_public_keys({u: m.content for u, m in adverts.items()})
        collected = {u: ask(u, ctxs[u], r) for u, r in server.collect_requests().items()}
    assert not any(m.has_error() for m in collected.values())
    notices = [m.content[wire.SECAGG_RECORD].get(wire.KEY_NOTICE) for m in collected.values()]
    assert notices == [wire.NOTICE_NO_TRUST_LIST] * 3  # no trust list: said in every reply
    assert sum("no-trust-list" in r.message for r in caplog.records) == 3 + 1  # once per node
    # Execute: run 2, a fresh state; the server makes keys and identities for 12 and 13
    v, a, b = sorted(NODES)
    ctx = context(v, 2, tmp_path)
    ask(v, ctx, atk.advertise_record("s2"))
    (_, pk1), (_, pk2) = generate_keypair(), generate_keypair()
    (_, qk1), (_, qk2) = generate_keypair(), generate_keypair()
    fa, fb = atk.forged_identity(a, "s2", pk1, pk2), atk.forged_identity(b, "s2", qk1, qk2)
    extra = {k: [*fa[k], *fb[k]] for k in (wire.KEY_PEER_IDENTITY, wire.KEY_PEER_SIGNATURE)}  # type: ignore[misc]
    collect = atk.collect_record([a, b], [pk1, qk1], [pk2, qk2], 2, "s2", "r2", extra, node=v)
    reply = ask(v, ctx, collect)
    # Assert
    assert reply.has_error() and reply.error.code == ERROR_SECAGG
    assert "never replaced" in str(reply.error.reason)
    assert (tmp_path / "secagg-pins" / "partition-00000.json").is_file()


def test_a_trust_list_removes_the_notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the simulated nodes' trust list (as ``fedge simulate`` writes it) the nodes accept
    each other, say nothing about a missing promise, and refuse a key not on the list."""
    monkeypatch.delenv(TRUST_ENV, raising=False)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    with node_privacy(tmp_path / "run", len(NODES)):
        trust = Path(os.environ[TRUST_ENV])
        ctxs = {
            u: Context(
                run_id=1,
                node_id=u,
                node_config={keys.NODE_PARTITION_ID: p},
                state=RecordDict(),
                run_config={},
            )
            for u, p in NODES.items()
        }
        listed = identity.parse_trust_list(trust.read_text(), str(trust))
        assert node_rules(ctxs[11]).trusted == listed and len(listed) == 3
        assert all(
            identity.public_bytes(identity.load_or_create(identity_path(c))) in listed
            for c in ctxs.values()
        )
        server = SecAggServerEngine(SecAggConfig(), sorted(NODES), atk.MASKED)
        adverts = {u: ask(u, ctxs[u], r) for u, r in server.advertise_requests().items()}
        server.receive_public_keys({u: m.content for u, m in adverts.items()})
        collected = {u: ask(u, ctxs[u], r) for u, r in server.collect_requests().items()}
        assert not any(m.has_error() for m in collected.values())
        assert all(wire.KEY_NOTICE not in m.content[wire.SECAGG_RECORD] for m in collected.values())
    assert os.environ.get(TRUST_ENV) is None  # restored


def test_the_state_dir_is_the_nodes_or_one_per_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node config, then environment, then beside the policy file, then one per app (by the
    names of its run-config keys, so runs of one app share it and two apps never do)."""
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.setenv("FEDGE_HOME", str(tmp_path / "home"))
    app_a1 = ledger_root({}, {"lr": 0.1, "rounds": 3})
    app_a2 = ledger_root({}, {"lr": 0.5, "rounds": 9})
    app_b = ledger_root({}, {"learning-rate": 0.1})
    assert app_a1 == app_a2 != app_b
    assert app_a1.parent == tmp_path / "home" / "privacy-state"
    assert ledger_root({"privacy-policy": str(tmp_path / "p" / "policy.toml")}) == (
        tmp_path / "p" / "privacy-state"
    )
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "env"))
    assert ledger_root({}, {"lr": 1}) == tmp_path / "env"
    assert ledger_root({NODE_STATE_DIR_KEY: str(tmp_path / "node")}) == tmp_path / "node"


def test_privacy_init_writes_the_strict_preset(tmp_path: Path) -> None:
    """The preset parses as the strictest policy, its trust list holds this node's key, and
    the node's state (identity, later ledger and pins) lives beside it."""
    result = CliRunner().invoke(
        cli, ["privacy", "init", str(tmp_path / "node"), "--partition", "2"]
    )
    assert result.exit_code == 0, result.output
    policy_path = tmp_path / "node" / "policy.toml"
    policy = PrivacyPolicy.parse(policy_path.read_text(), policy_path)
    assert policy.require_secagg and policy.require_dp and policy.once_per_model
    assert policy.min_noise >= 1.0 and policy.max_epsilon > 0
    assert policy.secagg_min_neighbours >= 4 and policy.secagg_min_threshold >= 3
    assert policy.trusted_keys == str(tmp_path / "node" / "trust.txt")
    ctx = Context(
        run_id=1,
        node_id=5,
        node_config={keys.NODE_PARTITION_ID: 2, "privacy-policy": str(policy_path)},
        state=RecordDict(),
        run_config={},
    )
    own = identity.public_bytes(identity.load_or_create(identity_path(ctx)))
    assert identity_path(ctx).parent.parent == tmp_path / "node" / "privacy-state"
    assert node_rules(ctx).trusted == frozenset({own})
    again = CliRunner().invoke(cli, ["privacy", "init", str(tmp_path / "node")])
    assert again.exit_code != 0  # never overwrites a policy without --force
