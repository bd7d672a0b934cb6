"""The random malicious server (:mod:`tests.privacy.adversary.malicious`) against fedge's client stack.

At least 500 seeded deviations per run of the suite, split between the two client stacks
(SecAgg+ alone, and SecAgg+ with distributed DP under a strict DP policy); more from
``python -m tests.privacy.adversary.run --n 10000``. None may recover an input sum of fewer
clients than a member accepts, leak a private value in clear, accept distributed-DP noise
below the policy's floor (the DP stack's real noise is checked on every accepted round),
recover an un-noised sum on the DP stack, or train twice on one re-encoded model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from flwr.app import Error, Message, MessageType, RecordDict

import fedge.clients.mods as client_mods
import fedge.clients.secagg.engine as client_engine
from fedge.secagg.binding import ContributionDigest
from tests.privacy.adversary.malicious import (
    CLASSES,
    STACK_DP,
    STACKS,
    Federation,
    Report,
    Seen,
    oracle,
    run,
    server_identity,
)

DEVIATIONS = 500
SEED = 2026


def test_500_seeded_deviations_recover_nothing() -> None:
    """Every deviation class runs; sums still come back from some rounds (the harness is not
    vacuous); no recovery, oracle or policy check finds a broken promise."""
    report = run(DEVIATIONS, SEED)
    print(json.dumps(report.as_dict(), indent=1))  # the classes and counts, for the log
    assert report.total >= DEVIATIONS
    assert set(report.deviations) == set(CLASSES)
    assert set(report.stacks) == set(STACKS) and min(report.stacks.values()) > 100
    assert report.outcomes["dp noise checked"] > 0
    assert report.outcomes["sum returned"] > 0 and report.recoveries_tried > 0
    assert report.outcomes["collect refused"] > 0 and report.outcomes["round failed"] > 0
    assert report.breaches == []


def test_the_harness_finds_the_attack_the_digest_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness can fail: with the contribution digest out of the mask keys (every client
    derives one constant), a server that sends every client but one learning rate 0 reads the
    victim's update off the sum, and the harness reports it (issue 30 item 1's class)."""
    monkeypatch.setattr(
        client_engine,
        "contribution_digest",
        lambda content, run_id=None: ContributionDigest(b"", b"", b""),
    )
    report = run(40, 3, ("config",))
    assert any("recovered the input sum" in b for b in report.breaches)


def test_the_harness_finds_noise_below_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise check can fail: with the clients' policy check taken out of
    ``dispatch_mods``, a server that sends one client of the distributed-DP stack a lower
    noise std (``dp-config``, e.g. 1e-9) gets it accepted and released, and the harness
    reports the client's real noise below its min-noise."""
    monkeypatch.setattr(client_mods, "check_train", lambda policy, msg, context: None)
    report = run(60, 5, ("dp-config",), (STACK_DP,))
    assert any("min-noise" in b for b in report.breaches)


def test_the_oracle_check_finds_a_private_value_in_a_refusal(tmp_path: Path) -> None:
    """The oracle check can fail too: a refusal that prints a client's loss is reported, one
    that prints only ids and hex is not."""
    fed = Federation(tmp_path, 3, random.Random(0))
    fed.fresh_inputs()
    loss = next(iter(fed.losses.values()))
    with server_identity():
        asked = Message(RecordDict(), dst_node_id=fed.nodes[0], message_type=MessageType.TRAIN)
        leaky = Message(Error(code=640, reason=f"train loss {loss} too high"), reply_to=asked)
        clean = Message(Error(code=640, reason="node 1003 round aec6ec720ecf6f2e"), reply_to=asked)
    report = Report()
    oracle(report, fed, Seen(replies=[clean]), "clean")
    assert report.breaches == []
    oracle(report, fed, Seen(replies=[leaky]), "leaky")
    assert len(report.breaches) == 1
