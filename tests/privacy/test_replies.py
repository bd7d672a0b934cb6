"""No oracle in a reply, and a node that says what it promises (issue 30 items 3, 4, 6).

Real Flower messages through fedge's ``dispatch_mods`` (policy, SecAgg+ mod, reply filter)
in front of a ClientApp whose private data the test chooses, on the in-process grid; the
ServerApp side is a script. Each test replays what leaked on main (2c7e381) and checks the
reply's clear fields no longer vary with the data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
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
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedge import keys
from fedge.clients.mods import dispatch_mods
from fedge.clients.privacy import replies
from fedge.clients.privacy.dpsgd import token_records
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.clients.privacy.policy import (
    DEFAULT_MIN_NOISE,
    POLICY_ENV,
    PolicyRefusal,
    PrivacyPolicy,
    check_train,
)
from fedge.clients.privacy.replies import ERROR_TRAINING, KEY_PROMISE, PROMISE_RECORD
from fedge.privacy.wire import KEY_DP_CLIP, KEY_DP_NOISE_STD
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.simulations.inprocess import DeviceTable, InProcessGrid
from tests.privacy.adversary.attacker import drive

SIZE = 16
SPEC = {"delta/w": (SIZE,), keys.KEY_WEIGHT: (1,), keys.KEY_COUNT: (1,)}
DATA: dict[str, Any] = {"seed": 0, "raise": False}  # this trial's private data (read by the app)
DPSGD = {"dp-sgd-noise-multiplier": 1.0, "weighting": "uniform"}


def private_data(pid: int) -> np.ndarray:
    """Partition ``pid``'s private data in the current trial: its length and values vary."""
    rng = np.random.default_rng([DATA["seed"], pid])
    return rng.normal(size=int(rng.integers(50, 800)))


def app() -> ClientApp:
    """A ClientApp behind dispatch_mods reporting, as fedge's own does, metrics of its data."""
    client = ClientApp(mods=[dispatch_mods])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        data = private_data(pid)
        if DATA["raise"]:  # a data-dependent failure, as token_records raised on main
            raise ValueError(f"a stream of {len(data)} tokens gives 0 DP-SGD records")
        delta = np.resize(data, SIZE).astype(np.float32) * 1e-3
        record = ArrayRecord(
            {
                "delta/w": Array(delta),
                keys.KEY_WEIGHT: Array(np.ones(1, np.float32)),
                keys.KEY_COUNT: Array(np.ones(1, np.float32)),
            }
        )
        metrics = MetricRecord(
            {
                keys.MET_TRAIN_LOSS: float(np.mean(data**2)),  # lower for a canary holder
                keys.MET_NUM_EXAMPLES: len(data),
                keys.MET_LOCAL_STEPS: 5,
                keys.MET_PARTITION: pid,
                "user-drift": float(np.abs(data).max()) / 10,  # a user's own metric
            }
        )
        content = RecordDict({keys.REC_CONTRIB: record, keys.REC_METRICS: metrics})
        return Message(content, reply_to=msg)

    @client.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        data = private_data(pid)  # its held-out split, as fedge's evaluate_reply reports it
        metrics = MetricRecord(
            {
                keys.MET_EVAL_LOSS: float(np.mean(data**2)),
                keys.MET_NUM_EXAMPLES: len(data),
                keys.MET_PARTITION: pid,
            }
        )
        return Message(RecordDict({keys.REC_METRICS: metrics}), reply_to=msg)

    return client


@pytest.fixture
def make_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str | None, int], InProcessGrid]:
    """A grid of ``n`` nodes under the policy text given (None: no policy file)."""

    runs: list[int] = []

    def build(policy: str | None, n: int = 1) -> InProcessGrid:
        if policy is not None:
            (tmp_path / "policy.toml").write_text(policy)
            monkeypatch.setenv(POLICY_ENV, str(tmp_path / "policy.toml"))
        else:
            monkeypatch.delenv(POLICY_ENV, raising=False)
        monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "node-state"))
        runs.append(n)  # each grid is a new run: its nodes' run state starts empty
        return InProcessGrid(app(), DeviceTable(n, seed=3), tmp_path / f"context-{len(runs)}")

    return build


def clear_fields(reply: Message) -> dict[str, Any]:
    """Everything of a reply a server reads in clear, but the (DP-noised) contribution."""
    if reply.has_error():
        return {"error": (reply.error.code, reply.error.reason)}
    content = reply.content
    return {
        "metrics": {n: dict(r) for n, r in content.metric_records.items()},
        "configs": {n: dict(r) for n, r in content.config_records.items()},
        "arrays": sorted(n for n in content.array_records if n != keys.REC_CONTRIB),
    }


def replies_over_trials(
    grid: InProcessGrid,
    config: dict[str, Any],
    trials: int,
    kind: str = MessageType.TRAIN,
) -> list[Any]:
    """One ``kind`` message per trial, each trial with freshly drawn private data."""

    def script(g: Grid) -> dict[str, Any]:
        node = sorted(g.get_node_ids())[0]
        seen = []
        for trial in range(trials):
            DATA["seed"] = 1000 + trial
            content = RecordDict({keys.REC_CONFIG: ConfigRecord(config)})
            msg = Message(content, dst_node_id=node, message_type=kind)
            (reply,) = list(g.send_and_receive([msg], timeout=60))
            seen.append(clear_fields(reply))
        return {"seen": seen}

    return drive(grid, script)["seen"]


@pytest.mark.parametrize("fail", [False, True], ids=["reply", "failure"])
def test_a_private_reply_is_the_same_whatever_the_data(
    make_grid: Callable[..., InProcessGrid], fail: bool
) -> None:
    """Randomized: 6 draws of private data (length 50-800, random values) under require-dp
    with DP-SGD. On main the clear metrics carried the un-noised training loss (the canary
    holder's was lower every round, at epsilon 0.15), the example count and the user's
    metric; a failure's reason carried the count ("a stream of 680 tokens gives 0 DP-SGD
    records"). Now every clear field is identical across draws: the public metrics only, or
    code 644 with a fixed reason. The same app with no policy and no DP shows the data (so
    this test can see a leak)."""
    DATA["raise"] = fail
    try:
        private = replies_over_trials(make_grid("require-dp = true\n"), DPSGD, 6)
        plain = replies_over_trials(make_grid(None), {"weighting": "uniform"}, 6)
    finally:
        DATA["raise"] = False
    assert all(seen == private[0] for seen in private)
    if fail:
        code, reason = private[0]["error"]
        assert code == ERROR_TRAINING and not any(ch.isdigit() for ch in reason)
    else:
        metrics = private[0]["metrics"][keys.REC_METRICS]
        assert set(metrics) == {keys.MET_LOCAL_STEPS, keys.MET_PARTITION}
        assert private[0]["configs"][PROMISE_RECORD][KEY_PROMISE] == "require-dp"
    if not fail:  # without privacy the data shows (and a raise is Flower's own error)
        assert len({str(seen) for seen in plain}) == 6


def test_evaluate_under_dpsgd_without_a_policy_keeps_the_loss_home(
    make_grid: Callable[..., InProcessGrid],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30, evaluate loss under DP-SGD without a policy file: on main the node answered
    a DP-SGD run's evaluate messages with its held-out loss and example count in clear (the
    loss of any adapter the server sends, outside every DP accounting; here it varies with
    the data in every one of 6 draws). Now the reply keeps only the public metrics, identical
    across draws, and the node's log says once why; without DP the loss still shows."""
    monkeypatch.setattr(replies, "_warned", set())  # a fresh node process
    with caplog.at_level(logging.WARNING, logger="fedge.clients.privacy.replies"):
        private = replies_over_trials(make_grid(None), DPSGD, 6, MessageType.EVALUATE)
    plain = replies_over_trials(make_grid(None), {"weighting": "uniform"}, 6, MessageType.EVALUATE)
    assert all(seen == private[0] for seen in private)
    assert set(private[0]["metrics"][keys.REC_METRICS]) == {keys.MET_PARTITION}
    assert private[0]["configs"][PROMISE_RECORD][KEY_PROMISE] == "none"
    assert any("held-out loss is outside" in r.message for r in caplog.records)
    assert len({str(seen) for seen in plain}) == 6
    assert keys.MET_EVAL_LOSS in plain[0]["metrics"][keys.REC_METRICS]


DISTRIBUTED_DP = {KEY_DP_CLIP: 1.0, KEY_DP_NOISE_STD: 0.5, "weighting": "uniform"}


@pytest.mark.parametrize("asked", [DPSGD, DISTRIBUTED_DP], ids=["dp-sgd", "distributed-dp"])
def test_evaluate_after_dp_training_keeps_the_loss_home_unmarked(
    make_grid: Callable[..., InProcessGrid], asked: dict[str, Any]
) -> None:
    """Issue 30, evaluate loss under distributed DP without a policy: on main a node that had
    just trained under distributed DP answered the run's evaluate messages (which carry no DP
    marker) with its held-out loss and example count in clear: they varied with the data in
    each of 6 draws. A server could equally leave the DP-SGD marker off its evaluates. Now the
    node remembers, in its run state, that the run asked for DP: every later evaluate reply of
    the run keeps only the public metrics, identical across draws, whatever the server sends."""
    grid = make_grid(None)

    def script(g: Grid) -> dict[str, Any]:
        node = sorted(g.get_node_ids())[0]
        seen = []
        for trial in range(7):
            DATA["seed"] = 2000 + trial
            kind, config = (MessageType.TRAIN, asked) if trial == 0 else (MessageType.EVALUATE, {})
            content = RecordDict({keys.REC_CONFIG: ConfigRecord(config)})
            msg = Message(content, dst_node_id=node, message_type=kind)
            (reply,) = list(g.send_and_receive([msg], timeout=60))
            seen.append(clear_fields(reply))
        return {"seen": seen[1:]}

    evaluated = drive(grid, script)["seen"]
    assert all(seen == evaluated[0] for seen in evaluated)
    assert set(evaluated[0]["metrics"][keys.REC_METRICS]) == {keys.MET_PARTITION}
    fresh = replies_over_trials(make_grid(None), {}, 6, MessageType.EVALUATE)
    assert len({str(seen) for seen in fresh}) == 6  # a run that never asked for DP shows the loss


def test_the_default_node_says_it_promises_nothing_once_per_run(
    make_grid: Callable[..., InProcessGrid],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No policy file: on main the node answered plain train messages without a word. Now
    each reply carries ``promise = none`` and the node's log says so once for the run,
    however many messages it answers."""
    monkeypatch.setattr(replies, "_announced", set())  # a fresh node process
    with caplog.at_level(logging.WARNING, logger="fedge.clients.privacy.replies"):
        seen = replies_over_trials(make_grid(None), {"weighting": "uniform"}, 3)
    assert all(s["configs"][PROMISE_RECORD][KEY_PROMISE] == "none" for s in seen)
    said = [r for r in caplog.records if "promises nothing" in r.message]
    assert len(said) == 1


def test_user_metrics_are_summed_under_secagg_and_dp_keeps_the_data_home(
    make_grid: Callable[..., InProcessGrid],
) -> None:
    """Three nodes under require-secagg. On main only a fixed list of metrics went into the
    masked sum and a user's ``user-drift`` vanished without a word; now it is summed (the
    server sees its sum, never one node's), while fedge's per-node partition id stays home.
    With DP-SGD asked for, the loss and the user's metric stay home too (their sum carries
    none of the noise) and only the public step count is summed."""
    grid = make_grid("require-secagg = true\n", 3)

    def script(g: Grid) -> dict[str, Any]:
        nodes = sorted(g.get_node_ids())
        out = {}
        for name, config in (("plain", {"weighting": "uniform"}), ("dp", DPSGD)):
            aggregator = SecAggPlusAggregator(SecAggConfig(num_shares=1.0, stage_timeout_s=60))
            content = RecordDict({keys.REC_CONFIG: ConfigRecord(config)})
            out[name] = aggregator.aggregate(g, 1, nodes, content, SPEC, 60)
        return out

    DATA["seed"] = 7
    out = drive(grid, script)
    drift = sum(float(np.abs(private_data(pid)).max()) / 10 for pid in range(3))
    plain, dp = out["plain"].summed_metrics, out["dp"].summed_metrics
    assert plain["user-drift"] == pytest.approx(drift, abs=0.05)
    assert plain[keys.MET_LOCAL_STEPS] == pytest.approx(15, abs=0.05)
    assert keys.MET_PARTITION not in plain
    assert set(dp) == {keys.MET_LOCAL_STEPS}


def test_require_dp_has_a_noise_floor_and_never_accepts_zero_noise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On main ``require-dp`` without ``min-noise`` accepted noise 0 (min-noise defaulted to
    0 and the check was z < 0). Now the floor defaults to 1.0 under require-dp or
    max-epsilon (z = 0.05 sqrt(3) / 0.1 = 0.87 is refused), and zero noise is refused even
    when min-noise = 0 is written out."""
    assert PrivacyPolicy(require_dp=True).min_noise == DEFAULT_MIN_NOISE == 1.0
    assert PrivacyPolicy(max_epsilon=4.0).min_noise == 1.0
    assert PrivacyPolicy().min_noise == 0.0
    assert PrivacyPolicy.parse("require-dp = true\n", Path("p.toml")).min_noise == 1.0
    explicit = PrivacyPolicy.parse("require-dp = true\nmin-noise = 0.0\n", Path("p.toml"))
    assert explicit.min_noise == 0.0
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)  # built as the ServerApp builds it
    context = Context(1, 5, {}, RecordDict(), {})
    for policy, std in ((PrivacyPolicy(require_dp=True), 0.05), (explicit, 0.0)):
        config = ConfigRecord({"dp-clip-norm": 0.1, "dp-noise-std": std})
        secagg = ConfigRecord(  # a collect with 2 neighbours, t = 2: 3 verified contributors
            {
                wire.KEY_STAGE: wire.STAGE_COLLECT,
                wire.KEY_NEIGHBOURS: wire.pack_ids([7, 8]),
                wire.KEY_THRESHOLD: 2,
            }
        )
        content = RecordDict({keys.REC_CONFIG: config, wire.SECAGG_RECORD: secagg})
        msg = Message(content, dst_node_id=5, message_type=MessageType.TRAIN)
        with pytest.raises(PolicyRefusal, match="min-noise"):
            check_train(policy, msg, context)


def test_a_short_stream_refusal_names_no_count() -> None:
    """On main: "a stream of 680 tokens gives 0 DP-SGD records of seq-len + 1 = 1001 tokens",
    the node's data size in the server's log. Now the text holds no number."""
    with pytest.raises(ValueError) as info:
        token_records(np.arange(680), 1000)
    text = str(info.value)
    assert "680" not in text and "1001" not in text and "0 DP-SGD" not in text
