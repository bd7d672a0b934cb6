"""Attack 4 and its relatives at the policy: non-finite DP numbers, the server's m, max-epsilon alone.

RUN against the code before the fix (commit 23d54ee, in a temporary worktree, a script
calling its ``check_train`` and ``Ledger`` with the messages below): ``dp-min-clients = 1e12``
passed a strict policy (require-dp, min-noise 1) while the same message without the claim
was refused for its client noise std/C = 0.002; a policy with max-epsilon 4 and no
require-dp accepted a message asking for no DP at all; and after three releases at z = 1
(one more refused: epsilon 10.7 > 4) ``record_release(nan)`` was accepted and the next
round passed, the NaN making the ledger's epsilon 0. ``dp-clip-norm = NaN`` was run over
Flower messages (``test_flower_attacks.py``) and did its damage.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV, Ledger
from fedge.clients.privacy.policy import PolicyRefusal, PrivacyPolicy, check_evaluate, check_train
from fedge.secagg import wire

STRICT = PrivacyPolicy(require_dp=True, min_noise=1.0, max_clip=0.1)


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages are built as the ServerApp builds them (Flower reads the task identity)."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)


def train(config: dict[str, object], secagg: bool = False) -> tuple[Message, Context]:
    """A train message carrying ``config`` (in a SecAgg+ collect, 2 neighbours, t = 2)."""
    content = RecordDict({keys.REC_CONFIG: ConfigRecord(config)})  # type: ignore[arg-type]
    if secagg:
        content[wire.SECAGG_RECORD] = ConfigRecord(
            {
                wire.KEY_STAGE: wire.STAGE_COLLECT,
                wire.KEY_NEIGHBOURS: wire.pack_ids([7, 8]),
                wire.KEY_THRESHOLD: 2,
            }
        )
    msg = Message(content, dst_node_id=5, message_type=MessageType.TRAIN)
    return msg, Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})


@pytest.mark.parametrize(
    "config",
    [
        {"dp-clip-norm": math.nan, "dp-noise-std": 0.0},
        {"dp-clip-norm": 0.05, "dp-noise-std": math.inf},
        {"dp-clip-norm": -1.0, "dp-noise-std": 0.1},
        {"dp-clip-norm": 0.05, "dp-noise-std": 0.1, "dp-min-clients": math.nan},
        {"dp-sgd-noise-multiplier": math.nan},
        {"dp-sgd-noise-multiplier": 1.0, "dp-sgd-max-grad-norm": math.inf},
    ],
)
def test_non_finite_dp_numbers_are_refused_naming_the_rule(config: dict[str, object]) -> None:
    msg, context = train(config)
    with pytest.raises(PolicyRefusal, match="finite number"):
        check_train(PrivacyPolicy(), msg, context)


def test_the_servers_contributor_count_does_not_lower_the_noise_checked() -> None:
    """On 23d54ee (run) the claim of 1e12 contributors made z = 2000 and the message passed."""
    # std/C = 0.002 on this client; the server claims 1e12 contributors (z would be 2000);
    # the client verifies 1 + 2t - n = 3 contributors: z = 0.002 sqrt(3)
    config = {"dp-clip-norm": 0.05, "dp-noise-std": 0.0001, "dp-min-clients": 1e12}
    msg, context = train(config, secagg=True)
    with pytest.raises(PolicyRefusal, match="below this node's min-noise"):
        check_train(STRICT, msg, context)


def test_max_epsilon_alone_requires_dp() -> None:
    """On 23d54ee (run) max-epsilon without require-dp accepted a message asking for no DP."""
    msg, context = train({"weighting": "uniform"})
    with pytest.raises(PolicyRefusal, match="implied by max-epsilon"):
        check_train(PrivacyPolicy(max_epsilon=4.0), msg, context)


def test_evaluate_is_refused_under_a_strict_policy_only() -> None:
    with pytest.raises(PolicyRefusal, match="evaluate reply would carry its own loss"):
        check_evaluate(PrivacyPolicy(require_secagg=True))
    check_evaluate(PrivacyPolicy())  # no policy: evaluation is the server's choice


def test_the_ledger_refuses_a_non_finite_release(tmp_path: Path) -> None:
    """On 23d54ee (run) a NaN release was recorded and max-epsilon stopped refusing."""
    ledger = Ledger(tmp_path / "ledger.json")
    with pytest.raises(ValueError, match="finite"):
        ledger.record_release(math.nan)
    assert ledger.releases() == []
    (tmp_path / "ledger.json").write_text('{"user-level": [1.0, NaN]}')
    with pytest.raises(ValueError, match="not a finite positive number"):
        ledger.releases()


def test_once_per_model_refuses_a_second_round_on_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Differencing: two rounds on one global model, cohorts differing by the victim. Without
    DP that difference is the victim's update; under once-per-model the second is refused."""
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    policy = PrivacyPolicy(once_per_model=True)
    model = ArrayRecord({"w": Array(np.arange(4, dtype=np.float32))})
    msg, context = train({"weighting": "uniform"})
    msg.content[keys.REC_GLOBAL] = model
    check_train(policy, msg, context)  # first round on this model: accepted
    with pytest.raises(ValueError, match="once-per-model"):
        check_train(policy, msg, context)
    msg.content[keys.REC_GLOBAL] = ArrayRecord({"w": Array(np.ones(4, dtype=np.float32))})
    check_train(policy, msg, context)  # a new model: accepted
