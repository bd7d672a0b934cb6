"""One digest of everything a contribution depends on, mixed into every pairwise mask key.

Issue 30 items 1 and 2, run against main at 2c7e381 (2026-12-04, these tests with
``PYTHONPATH`` on that checkout, where the engine ignored the SecAgg+ record's numbers):

* every client but the victim sent ``clipping-range = 1e30``, an otherwise honest round
  (honest keys, one consistent unmask, no drop-outs): the others' inputs quantized to the
  midpoint, dequantized to exactly 0, their masks still cancelled, and the server engine's
  own "sum" was the victim's input (max error 3.6e-6 on values up to 1.25; one quantization
  level is 3.8e-6);
* ``once-per-model`` passed a second round on the same global model sent with one weight
  ``-0.0`` instead of ``0.0``, or with an extra array record the client ignores, or as
  float64: two sums over one model whose cohorts differ by one client.

Now any per-client difference in a protocol number, the graph, the config or the model
leaves the victim's pair masks uncancelled (the "sum" is uniform noise), and
``once-per-model`` keys on the canonical model digest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.clients.privacy.policy import PolicyRefusal, PrivacyPolicy, check_train
from fedge.secagg import wire
from fedge.secagg.binding import contribution_digest
from fedge.secagg.config import SecAggConfig
from fedge.server.secagg.engine import SecAggServerEngine
from tests.privacy.adversary import attacker as atk

Tamper = Callable[[int, RecordDict], None]


def honest_round(tamper: Tamper, n: int = 4, victim_index: int = 0) -> tuple[dict, dict]:
    """One SecAgg+ round through the real server engine; ``tamper(node, request)`` edits each
    collect request before it is sent. Returns (the server's sum, every client's input)."""
    fed = {100 + i: atk.secret_input(40 + i) for i in range(n)}
    states: dict[int, ConfigRecord] = {}
    server = SecAggServerEngine(SecAggConfig(), sorted(fed), atk.MASKED)

    def ask(node: int, content: RecordDict) -> RecordDict:
        return atk.engine(node, states).handle(content, lambda: fed[node])

    server.receive_public_keys({u: ask(u, r) for u, r in server.advertise_requests().items()})
    requests = server.collect_requests()
    for node, req in requests.items():
        req[keys.REC_CONFIG] = ConfigRecord({"lr": 0.1})
        tamper(node, req)
    server.receive_masked_inputs({u: ask(u, r) for u, r in requests.items()})
    summed = None
    while summed is None:
        replies = {u: ask(u, r) for u, r in server.unmask_requests().items()}
        summed = server.receive_unmask_shares(replies)
    return summed, fed


def close(a: np.ndarray, b: np.ndarray) -> bool:
    step = 2 * atk.CFG.clipping_range / atk.CFG.quantization_range
    return bool(np.max(np.abs(a - b)) <= 4 * step)


def test_the_honest_round_sums_every_input() -> None:
    """Control: untampered, the sum is the sum (so the attacks below can fail)."""
    summed, fed = honest_round(lambda node, req: None)
    assert close(summed["delta/w"], sum(x["delta/w"] for x in fed.values()))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (wire.KEY_CLIPPING_RANGE, 1e30),  # issue 30 item 1: recovered the victim's input on main
        (wire.KEY_QUANTIZATION_RANGE, 3),
        (wire.KEY_SCALE_NAMES, ["delta/w"]),
        (wire.KEY_OMIT_ZERO, ["nothing"]),
        ("an-unknown-field", 1),
    ],
)
def test_a_per_client_protocol_number_leaves_the_masks_uncancelled(
    field: str, value: object
) -> None:
    """Every client but the victim is sent ``field = value``. With clipping range 1e30 the
    others' inputs dequantize to 0, so on main the sum was the victim's input (run, see the
    module doc); now the victim's pair masks do not cancel and the sum is noise."""
    victim = 100

    def tamper(node: int, req: RecordDict) -> None:
        if node != victim:
            rec = req[wire.SECAGG_RECORD]
            rec[field] = value  # type: ignore[index]
            if field == wire.KEY_SCALE_NAMES:
                rec[wire.KEY_SCALE_VALUES] = [1.0]  # type: ignore[index]

    summed, fed = honest_round(tamper)
    got = summed["delta/w"]
    assert not close(got, fed[victim]["delta/w"])
    assert not close(got, sum(x["delta/w"] for x in fed.values()))
    assert np.std(got) > 100 * np.std(fed[victim]["delta/w"])  # uniform over the whole range


def test_a_per_client_config_or_graph_leaves_the_masks_uncancelled() -> None:
    """The config (here a learning rate of 0 for all but the victim, who then alone makes an
    update) and the round graph are covered too."""
    victim = 100

    def zero_lr(node: int, req: RecordDict) -> None:
        if node != victim:
            req[keys.REC_CONFIG] = ConfigRecord({"lr": 0.0})

    summed, fed = honest_round(zero_lr)
    assert not close(summed["delta/w"], sum(x["delta/w"] for x in fed.values()))


def test_the_digest_is_canonical_and_total() -> None:
    """Record and key order, int vs float, -0.0 and NaN payloads, dtype and wire encoding of
    one value do not change it; any value a client reads differently does."""

    def content(**over: object) -> RecordDict:
        w = over.get("w", np.array([0.0, 1.5, np.nan], np.float32))
        cfg = over.get("cfg", {"lr": 0.1, "steps": 2})
        rec = over.get("rec", {wire.KEY_CLIPPING_RANGE: 8.0, wire.KEY_ROUND: "r"})
        out = RecordDict()
        names = ["config", "global", wire.SECAGG_RECORD]
        for name in reversed(names) if over.get("reverse") else names:
            if name == "global":
                out[name] = ArrayRecord({"w": Array(np.asarray(w))})
            elif name == "config":
                out[name] = ConfigRecord(cfg)  # type: ignore[arg-type]
            else:
                out[name] = ConfigRecord(rec)  # type: ignore[arg-type]
        return out

    base = contribution_digest(content())
    same = [
        content(reverse=True),
        content(w=np.array([-0.0, 1.5, -np.nan], np.float32)),
        content(w=np.array([0.0, 1.5, np.nan], np.float64)),
        content(w=np.array([0.0, 1.5, np.nan], ">f4")),
        content(cfg={"steps": 2.0, "lr": 0.1}),
        content(rec={wire.KEY_ROUND: "r", wire.KEY_CLIPPING_RANGE: 8}),
        content(rec={wire.KEY_ROUND: "r", wire.KEY_CLIPPING_RANGE: 8.0, wire.KEY_THRESHOLD: 3}),
    ]
    for c in same:
        assert contribution_digest(c) == base
    different = [
        content(w=np.array([0.0, 1.5000001, np.nan], np.float32)),
        content(w=np.array([0.0, 1.5], np.float32)),
        content(cfg={"lr": 0.1, "steps": 2, "extra": ""}),
        content(cfg={"lr": "0.1", "steps": 2}),
        content(rec={wire.KEY_CLIPPING_RANGE: 8.0 + 1e-12, wire.KEY_ROUND: "r"}),
        content(rec={wire.KEY_CLIPPING_RANGE: 8.0, wire.KEY_ROUND: "r", "new": b""}),
    ]
    for c in different:
        assert contribution_digest(c).whole != base.whole
    assert contribution_digest(content(), run_id=1).whole != contribution_digest(content()).whole


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages are built as the ServerApp builds them (Flower reads the task identity)."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.mark.parametrize(
    "variant",
    ["negative-zero", "extra-array-record", "float64", "new-config", "extra-config-record"],
)
def test_once_per_model_is_not_bypassed_by_an_encoding(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30 item 2: on main (run) the -0.0, extra-array-record and float64 variants were
    accepted as new models, so two sums over one model differed by one client. Now each is
    the same model, refused; the extra array record is refused by name."""
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    policy = PrivacyPolicy(once_per_model=True)
    weights = np.array([0.0, 1.0, 2.0], np.float32)

    def message(w: np.ndarray, config: dict[str, object]) -> tuple[Message, Context]:
        content = RecordDict(
            {
                keys.REC_GLOBAL: ArrayRecord({"w": Array(w)}),
                keys.REC_CONFIG: ConfigRecord(config),  # type: ignore[arg-type]
            }
        )
        msg = Message(content, dst_node_id=5, message_type=MessageType.TRAIN)
        ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
        return msg, ctx

    check_train(policy, *message(weights, {"lr": 0.1}))
    msg, ctx = message(weights, {"lr": 0.1})
    if variant == "negative-zero":
        msg, ctx = message(np.array([-0.0, 1.0, 2.0], np.float32), {"lr": 0.1})
    elif variant == "extra-array-record":
        msg.content["ignored"] = ArrayRecord({"x": Array(np.ones(1, np.float32))})
    elif variant == "float64":
        msg, ctx = message(weights.astype(np.float64), {"lr": 0.1})
    elif variant == "new-config":
        msg, ctx = message(weights, {"lr": 0.1000001})
    else:
        msg.content["ignored"] = ConfigRecord({"x": 1})
    with pytest.raises((PolicyRefusal, ValueError), match="once-per-model"):
        check_train(policy, msg, ctx)


class PerClientNumbers:
    """A Grid that sends every node but ``victim`` ``clipping-range = 1e30`` at collect."""

    def __init__(self, grid: Any, victim: Callable[[list[int]], int]) -> None:
        self.grid, self.victim = grid, victim

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        nodes = sorted(m.metadata.dst_node_id for m in messages)
        for m in messages:
            rec = m.content.config_records.get(wire.SECAGG_RECORD)
            is_collect = rec is not None and rec.get(wire.KEY_STAGE) == wire.STAGE_COLLECT
            if is_collect and m.metadata.dst_node_id != self.victim(nodes):
                rec[wire.KEY_CLIPPING_RANGE] = 1e30
        return self.grid.send_and_receive(messages, timeout=timeout)


def test_the_clipping_attack_over_flower_messages_under_the_strictest_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30 item 1 with the strictest documented policy (trust list of every identity,
    min-neighbours 4, min-threshold 3, once-per-model, require-dp with min-noise 1), five
    nodes, distributed DP, fedge's own aggregators: only the collect messages of all but one
    node carry clipping range 1e30. On main (2c7e381, this test run there) the "sum" was the
    victim's update alone: the four others dequantize to exactly 0, leaving its clipped delta
    (norm 0.05) and its own noise share (std 0.03 per value: noise multiplier 0.6 on one
    client's update, where its policy says min-noise 1; measured sum std 0.033, norm 0.26),
    and it passed the aggregate bound, so the server would have applied it. Now the sum is
    noise over the quantizer's whole range and fails the bound."""
    result = atk.strictest_round(
        tmp_path, monkeypatch, through=lambda g: PerClientNumbers(g, lambda nodes: nodes[0])
    )
    assert result.summed is not None and len(result.accepted) == 5, result.rejected
    assert float(np.std(result.summed["delta/w"])) > 1.0  # uniform noise, not one update
    assert result.out_of_bounds is not None


def test_an_extra_tensor_in_the_global_model_is_refused_not_ignored() -> None:
    """The last once-per-model bypass of issue 30 item 2: on main (read from its code) the
    client's ``set_adapter`` ignored a tensor the model lacks, so the same global model with
    one extra key in its record had a new digest and trained a second time. Now loading it
    fails before any training, so the re-encoded model releases nothing."""
    import torch

    from fedge.lm import holder

    lm = holder.LoraModel(
        model=torch.nn.Linear(1, 1),
        params={"w": torch.nn.Parameter(torch.zeros(3))},
        device=torch.device("cpu"),
        initial={},
    )
    holder.set_adapter(lm, {"w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="the model lacks"):
        holder.set_adapter(lm, {"w": np.ones(3, np.float32), "ignored": np.zeros(1, np.float32)})
