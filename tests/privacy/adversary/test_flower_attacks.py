"""Attacks 3 and 4 over real Flower messages: fedge's ClientApp stack behind the in-process grid.

Each node runs ``dispatch_mods`` (policy check, SecAgg+ mod, distributed-DP mod) in front
of a ClientApp with a known contribution, under a strict policy file. The ServerApp side
is a script. Both attacks did their damage on main (run against commit 23d54ee
on 2026-12-02): attack 3 recovered one node's exact contribution, attack 4 got the sum
back with no noise (the NaN it leaves in each ledger is read from that code, not run); now
the clients refuse, naming the rule. Two more cases below: a refusal that named a data
value, and the honest control under the strictest policy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.clients.privacy.policy import POLICY_ENV
from fedge.secagg.config import SecAggConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.server.secagg.engine import SecAggServerEngine
from fedge.simulations.inprocess import DeviceTable, InProcessGrid
from tests.privacy.adversary import attacker as atk
from tests.secagg.harness import CRASH_KEY, known_client_app

POLICY = "require-secagg = true\nrequire-dp = true\nmin-noise = 1.0\nmax-clip = 0.1\nmax-epsilon = 50.0\n"


@pytest.fixture
def grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> InProcessGrid:
    """Three nodes under the strict policy, each with its own ledger and identity on disk."""
    (tmp_path / "policy.toml").write_text(POLICY)
    monkeypatch.setenv(POLICY_ENV, str(tmp_path / "policy.toml"))
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "node-state"))
    app = known_client_app(atk.contribution, lambda pid: 1.0 + pid)
    return InProcessGrid(app, DeviceTable(3, seed=7), tmp_path / "context")


def send(
    grid: Grid, requests: Mapping[int, RecordDict], config: ConfigRecord
) -> tuple[dict[int, RecordDict], dict[int, str]]:
    """One exchange of train messages carrying ``config``; replies and refusals by node."""
    messages = []
    for node, req in requests.items():
        body = RecordDict({keys.REC_CONFIG: config, **dict(req.items())})
        messages.append(Message(body, dst_node_id=node, message_type=MessageType.TRAIN))
    out, errors = {}, {}
    for reply in grid.send_and_receive(messages, timeout=60):
        if reply.has_error():
            errors[reply.metadata.src_node_id] = reply.error.reason
        else:
            out[reply.metadata.src_node_id] = reply.content
    return out, errors


def test_attack3_over_flower_messages_recovers_nothing(grid: InProcessGrid, tmp_path: Path) -> None:
    """Inconsistent drop-out lists over real messages, honest keys, default SecAggConfig.

    Before the fix this script recovered the victim's exact input over these same Flower
    messages (run against the old client engine); now the victim refuses the unmask step.
    """
    # Prepare: SecAgg+ without DP (DP's clipping would hide what the attack recovers)
    (tmp_path / "policy.toml").write_text("require-secagg = true\n")
    config = ConfigRecord({"weighting": "uniform"})

    def script(g: Grid) -> dict[str, Any]:
        nodes = sorted(g.get_node_ids())
        server = SecAggServerEngine(SecAggConfig(), nodes, "masked")
        server.receive_public_keys(send(g, server.advertise_requests(), config)[0])
        collected, _ = send(g, server.collect_requests(), config)
        server.receive_masked_inputs(collected)
        v, a, b = nodes
        fwd = {u: dict(server._r.forward[u]) for u in nodes}
        s, r = server.keys.session, server.round_id
        plan = {
            v: atk.unmask_record(s, r, [v, b], [a], [(b, fwd[v][b])]),
            a: atk.unmask_record(s, r, [a, v, b], [], [(v, fwd[a][v])]),
            b: atk.unmask_record(s, r, [b, a], [v], [(a, fwd[b][a])]),
        }
        replies, refusals = send(g, plan, config)
        return {"nodes": nodes, "collected": collected, "replies": replies, "refusals": refusals}

    # Execute
    out = atk.drive(grid, script)
    v, a, b = out["nodes"]
    collected, refusals = out["collected"], out["refusals"]
    shares, seeds = atk.revealed(list(out["replies"].items()))
    masked = {k: x.numpy() for k, x in collected[v]["masked"].items()}
    recovered = atk.recover(v, masked, [a, b], shares.get(v, []), seeds)
    # Assert: no partition's contribution recovered (to one quantization level)
    truths = [atk.contribution(pid) for pid in range(3)]
    assert not any(atk.matches(recovered, {"delta/w": t["delta/w"]}) for t in truths)
    assert any("live neighbours" in why for why in refusals.values())


def test_attack4_a_nan_clip_norm_is_refused_and_the_ledger_stays_finite(
    grid: InProcessGrid, tmp_path: Path
) -> None:
    """``dp-clip-norm = NaN`` with zero noise: on main every comparison was false and the sum
    came back un-noised (run); each ledger recorded a NaN release (read from the code)."""
    # Prepare
    evil = ConfigRecord(
        {"weighting": "uniform", "dp-clip-norm": math.nan, "dp-noise-std": 0.0, "dp-min-clients": 3}
    )
    aggregator = SecAggPlusAggregator(SecAggConfig(num_shares=1.0, stage_timeout_s=60))

    def script(g: Grid) -> dict[str, Any]:
        nodes = sorted(g.get_node_ids())
        content = RecordDict({keys.REC_CONFIG: evil})
        return {"result": aggregator.aggregate(g, 1, nodes, content, atk.SPEC, 60)}

    # Execute
    result = atk.drive(grid, script)["result"]
    # Assert: no sum; every node refused naming the rule; no ledger holds a NaN
    assert result.summed is None
    reasons = list(result.rejected.values())
    assert len(reasons) == 3 and all("finite" in why for why in reasons)
    for path in (tmp_path / "node-state").rglob("*.json"):
        releases = json.loads(path.read_text()).get("user-level", [])
        assert all(math.isfinite(z) for z in releases)


def test_a_refusal_never_reports_a_data_dependent_value(
    grid: InProcessGrid, tmp_path: Path
) -> None:
    """A tiny clipping range: on main every refusal carried the contribution's peak |value|
    (its reason read "reaches <peak> after scaling": max |delta| leaked every round, read
    from main's code, not run); the fix after it still refused per array, a bit oracle (30
    rounds of ranges bisected a client's max |delta| to 9 digits). Now the client clips into
    the range and refuses nothing: the round completes, no reply says anything of the data,
    and each summed value is within the three clients' clipped range."""
    # Prepare
    (tmp_path / "policy.toml").write_text("require-secagg = true\n")
    clip = 1e-3
    aggregator = SecAggPlusAggregator(SecAggConfig(num_shares=1.0, clipping_range=clip))
    content = RecordDict({keys.REC_CONFIG: ConfigRecord({"weighting": "uniform"})})

    def script(g: Grid) -> dict[str, Any]:
        return {
            "result": aggregator.aggregate(g, 1, sorted(g.get_node_ids()), content, atk.SPEC, 60)
        }

    # Execute
    result = atk.drive(grid, script)["result"]
    # Assert: nothing refused, the sum is of clipped values (3 clients x range + quantization)
    assert result.rejected == {} and len(result.accepted) == 3
    assert result.summed is not None
    assert float(np.max(np.abs(result.summed["delta/w"]))) <= 3 * clip * 1.01


def test_an_honest_round_under_the_strictest_policy_completes_with_a_dropout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five nodes holding every rule of ``atk.STRICTEST`` and a trust list of their
    identities; one crashes while training. The honest SecAgg+ round with distributed DP
    still sums the other four."""
    # Execute: partition 2 crashes while training
    result = atk.strictest_round(tmp_path, monkeypatch, config={CRASH_KEY: "2"})
    # Assert: four contributors, a sum (noised), the crashed node the only one rejected
    assert result.summed is not None, result.rejected
    assert len(result.accepted) == 4 and len(result.rejected) == 1
    assert abs(float(result.summed["meta/count"][0]) - 4.0) < 0.01
