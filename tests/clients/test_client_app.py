"""The ClientApp's handlers called in-process with real Flower messages on the micro zoo."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from flwr.app import Context, Message, Metadata, RecordDict

import fedge.clients.app as client_module
from fedge import keys
from fedge.clients.state import ContextStore
from fedge.lm import holder
from fedge.lm.config import TrainConfig
from fedge.paths import zoo_dir
from fedge.server.aggregation import validate_contribution
from fedge.server.config import RunConfig
from fedge.server.loop import train_content
from fedge.simulations.apps import clientapp as simulated_app
from fedge.simulations.devices import DeviceBehaviour, local_work
from fedge.strategies.base import GlobalState
from fedge.strategies.registry import build_strategy

SMALL = {
    "local-steps": 2,
    "batch-size": 2,
    "seq-len": 32,
    "lora-r": 2,
    "lora-alpha": 4,
    "max-chars-per-client": 20000,
    "eval-batches": 2,
}


def message_to_node(content: RecordDict, message_type: str) -> Message:
    """A message from the server (node 0) to node 7, as a SuperNode hands it to the ClientApp."""
    metadata = Metadata(
        run_id=1,
        message_id="m",
        src_node_id=0,
        dst_node_id=7,
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=3600.0,
        message_type=message_type,
    )
    return Message(content=content, metadata=metadata)


def _context(partition: int = 1) -> Context:
    """A node whose model root holds the micro zoo's models (the server names them by name)."""
    return Context(
        run_id=1,
        node_id=7,
        node_config={
            "partition-id": partition,
            "num-partitions": 3,
            "model-root": str(zoo_dir("micro").resolve()),
        },
        state=RecordDict(),
        run_config={},
    )


def _setup(micro_zoo, **overrides):  # type: ignore[no-untyped-def]
    cfg = RunConfig.from_mapping({**SMALL, "model": str(micro_zoo.target_dir), **overrides})
    strategy = build_strategy(cfg.to_mapping())
    adapter = holder.adapter_arrays(holder.get_lora_model(cfg.model, cfg.train))
    state = GlobalState(adapter, strategy.init_extras(adapter))
    return cfg, strategy, state


def test_train_replies_a_valid_contribution_and_reuses_the_cached_model(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """Two train calls in one process: one base-model load, a spec-conforming contribution each time."""
    cfg, strategy, state = _setup(micro_zoo)
    msg = message_to_node(train_content(state, strategy, cfg, 1), "train")
    first = client_module.app(msg, _context())
    second = client_module.app(msg, _context())
    for reply in (first, second):
        assert not reply.has_error()
        record = reply.content.array_records[keys.REC_CONTRIB]
        assert validate_contribution(record, strategy.contribution_spec(state)) is None
    m1, m2 = (dict(r.content.metric_records[keys.REC_METRICS]) for r in (first, second))
    assert m1[keys.MET_MODEL_LOADS] == m2[keys.MET_MODEL_LOADS]  # no reload on the second call
    assert m2[keys.MET_CALLS] == m1[keys.MET_CALLS] + 1
    assert m1[keys.MET_PARTITION] == 1
    assert (
        m1[keys.MET_NUM_EXAMPLES]
        == len(holder.get_corpus(cfg.client_config()).client(1).train) // 32
    )
    # Same seed, round and partition: the local work is reproducible bit for bit.
    a, b = (r.content.array_records[keys.REC_CONTRIB] for r in (first, second))
    for k in a:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy())
    delta = next(
        v.numpy() for k, v in a.items() if k.startswith(keys.PREFIX_DELTA) and "lora_A" in k
    )
    assert np.abs(delta).max() > 0


@pytest.mark.parametrize(("strategy", "count"), [("fedavg", 0.0), ("fedprox", 1.0)])
def test_straggler_work_dropped_by_fedavg_kept_by_fedprox(
    micro_zoo, strategy: str, count: float
) -> None:  # type: ignore[no-untyped-def]
    """straggler-fraction 1 and 4 local steps: the device mod budgets 1 step; FedAvg zeroes it, FedProx keeps it."""
    cfg, strat, state = _setup(
        micro_zoo, strategy=strategy, **{"straggler-fraction": 1.0, "local-steps": 4}
    )
    reply = simulated_app(message_to_node(train_content(state, strat, cfg, 1), "train"), _context())
    metrics = dict(reply.content.metric_records[keys.REC_METRICS])
    assert metrics[keys.MET_LOCAL_STEPS] == 1 and metrics[keys.MET_COMPLETED] == 0.25
    contribution = reply.content.array_records[keys.REC_CONTRIB]
    assert float(contribution[keys.KEY_COUNT].numpy()[0]) == count


def test_scaffold_client_keeps_its_control_variate_in_the_node_state(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """A SCAFFOLD train call stores c_i+ in Context.state and sends ctrl/ deltas of the adapter's shapes."""
    cfg, strategy, state = _setup(micro_zoo, strategy="scaffold")
    context = _context()
    reply = client_module.app(
        message_to_node(train_content(state, strategy, cfg, 1), "train"), context
    )
    record = reply.content.array_records[keys.REC_CONTRIB]
    assert validate_contribution(record, strategy.contribution_spec(state)) is None
    saved = ContextStore(context.state).load(2)
    assert saved is not None and set(saved) == set(state.adapter)
    ctrl = {
        k[len(keys.PREFIX_CONTROL) :]: record[k].numpy()
        for k in record
        if k.startswith(keys.PREFIX_CONTROL)
    }
    for name, c_new in saved.items():  # c_i was 0, so ctrl = c_i+ - 0
        np.testing.assert_allclose(ctrl[name], c_new, rtol=1e-6)


def test_evaluate_reports_heldout_loss(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """Evaluate returns a finite loss near ln(vocab) or below for the untrained adapter."""
    cfg, strategy, state = _setup(micro_zoo)
    reply = client_module.app(
        message_to_node(train_content(state, strategy, cfg, 1), "evaluate"), _context(2)
    )
    metrics = dict(reply.content.metric_records[keys.REC_METRICS])
    assert 0 < metrics[keys.MET_EVAL_LOSS] < np.log(1024) + 1
    assert metrics[keys.MET_NUM_EXAMPLES] > 0


def test_a_message_without_config_is_refused_with_the_record_name(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """No 'config' ConfigRecord: the handler says which record is missing."""
    with pytest.raises(ValueError, match="'config' ConfigRecord"):
        client_module.app(message_to_node(RecordDict(), "train"), _context())


def test_train_config_errors_name_the_key() -> None:
    """Bad values are refused with the hyphenated key in the message."""
    with pytest.raises(ValueError, match="local-steps"):
        TrainConfig.from_config({"local-steps": 0})
    with pytest.raises(ValueError, match="batch-size"):
        TrainConfig.from_config({"batch-size": "many"})
    with pytest.raises(ValueError, match="device-population"):
        DeviceBehaviour(population="phone:half")


def test_device_population_caps_local_work() -> None:
    """A population of only phones doing a quarter of the work runs 2 of 8 steps every round."""
    phones = DeviceBehaviour(population="phone:1:0.25")
    assert local_work(phones, local_steps=8, seed=0, server_round=3, partition=5) == 2
    assert local_work(DeviceBehaviour(), 8, 0, 3, 5) == 8


def test_the_deployed_client_app_ignores_device_keys(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """Without the simulation's device mod, straggler keys change nothing: all local steps run."""
    cfg, strat, state = _setup(micro_zoo, **{"straggler-fraction": 1.0, "local-steps": 2})
    reply = client_module.app(
        message_to_node(train_content(state, strat, cfg, 1), "train"), _context()
    )
    assert dict(reply.content.metric_records[keys.REC_METRICS])[keys.MET_LOCAL_STEPS] == 2


def _ctrl(reply: Message) -> dict[str, np.ndarray]:
    record = reply.content.array_records[keys.REC_CONTRIB]
    return {
        k[len(keys.PREFIX_CONTROL) :]: record[k].numpy()
        for k in record
        if k.startswith(keys.PREFIX_CONTROL)
    }


def test_a_rejected_scaffold_reply_leaves_c_i_unchanged(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """Round 1's reply was not accepted (committed round stays 0): round 2 trains from c_i = 0.

    With c_i = 0 the control delta is c_i+ itself; had the unaccepted round-1 state been
    used, round 2's delta would be c_i+ - c_i(round 1), which differs.
    """
    cfg, strategy, state = _setup(micro_zoo, strategy="scaffold")
    context = _context()
    pid = 1
    store = ContextStore(context.state)
    for server_round in (1, 2):
        content = train_content(state, strategy, cfg, server_round, committed={pid: 0})
        reply = client_module.app(message_to_node(content, "train"), context)
    pending = store.load(3)
    assert pending is not None and store.load(2) is not None  # both rounds kept as pending
    for name, delta in _ctrl(reply).items():
        np.testing.assert_allclose(delta, pending[name], rtol=1e-5, atol=1e-7)


def test_an_accepted_scaffold_reply_advances_c_i(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """Round 1 accepted (committed round 1): round 2 corrects with c_i from round 1."""
    cfg, strategy, state = _setup(micro_zoo, strategy="scaffold")
    context = _context()
    client_module.app(
        message_to_node(train_content(state, strategy, cfg, 1, committed={1: 0}), "train"), context
    )
    c_1 = ContextStore(context.state).load(2)
    reply = client_module.app(
        message_to_node(train_content(state, strategy, cfg, 2, committed={1: 1}), "train"), context
    )
    c_2 = ContextStore(context.state).load(3)
    assert c_1 is not None and c_2 is not None
    for name, delta in _ctrl(reply).items():
        np.testing.assert_allclose(delta, c_2[name] - c_1[name], rtol=1e-4, atol=1e-6)


def test_scaffold_trains_with_sgd_unless_told_otherwise(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """optimizer=auto is the strategy's own local update: SGD for SCAFFOLD, AdamW otherwise."""
    from fedge.clients.trainer import resolve_optimizer

    scaffold = build_strategy({"strategy": "scaffold"})
    fedavg = build_strategy({"strategy": "fedavg"})
    assert resolve_optimizer(TrainConfig(), scaffold.local_optimizer) == "sgd"
    assert resolve_optimizer(TrainConfig(), fedavg.local_optimizer) == "adamw"
    assert resolve_optimizer(TrainConfig(optimizer="adamw"), scaffold.local_optimizer) == "adamw"


# A query answered by a fresh process, as the Deployment Engine starts one per message.
QUERY_IN_A_FRESH_PROCESS = """
import json, sys, time
from flwr.app import Context, Message, Metadata, RecordDict
from fedge.clients.app import app
metadata = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=7, reply_to_message_id="",
                    group_id="0", created_at=time.time(), ttl=60.0, message_type="query")
node = Context(run_id=1, node_id=7, node_config={"partition-id": 2}, state=RecordDict(), run_config={})
reply = app(Message(content=RecordDict(), metadata=metadata), node)
heavy = [m for m in ("torch", "transformers", "peft", "opacus") if m in sys.modules]
print(json.dumps({"metrics": dict(reply.content.metric_records["metrics"]), "heavy": heavy}))
"""


def test_loading_the_app_and_answering_a_query_imports_no_training_stack() -> None:
    """A node process that only reports its partition imports neither torch, transformers, peft
    nor opacus: the Deployment Engine starts one ClientApp process per message, and importing
    them cost each query process about 5 CPU seconds (0.7 s without).

    Before the training work moved to `fedge.clients.rounds`, `fedge.clients.app` imported them at load
    (checked: it reported ["torch", "transformers"])."""
    out = subprocess.run(
        [sys.executable, "-c", QUERY_IN_A_FRESH_PROCESS],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answer = json.loads(out.stdout.splitlines()[-1])
    assert answer["metrics"][keys.MET_PARTITION] == 2
    assert answer["heavy"] == []
