"""A malicious server over real Flower messages: the clients refuse every attack, the server reports it.

One run on the in-process engine (the attacks are in the messages' content, which the
clients' mods judge the same on any engine; on Flower's Ray simulation the run cost a Ray
start, 22 s of a loaded suite), four nodes whose policy file (``FEDGE_PRIVACY_POLICY``)
requires SecAgg+ and distributed DP with z >= 1 and C <= 0.1. The ServerApp plays the
attacker: it omits SecAgg+, asks for less noise, sends a SecAgg+ threshold of half the
neighbourhood, asks one client for both secrets of a node, and names a module to import.
An honest round under the same policy is the control.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.clients.privacy.ledger import STATE_DIR_ENV
from fedge.clients.privacy.policy import POLICY_ENV
from fedge.privacy.wire import MET_DP_TRAIN_LOSS
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from fedge.server.aggregation import PlainAggregator
from fedge.server.privacy.aggregators import DistributedDPAggregator
from fedge.server.privacy.config import DPConfig
from fedge.server.secagg.aggregator import SecAggPlusAggregator
from fedge.server.secagg.engine import SecAggRoundFailed, SecAggServerEngine
from fedge.server.secagg.protocol import run_secagg
from tests.secagg.harness import known_client_app, partition_ids, simulate

NUM_NODES = 4
SIZE = 200
SPEC = {"delta/w": (SIZE,), "meta/weight": (1,), "meta/count": (1,)}
POLICY = "require-secagg = true\nrequire-dp = true\nmin-noise = 1.0\nmax-clip = 0.1\n"
EVIL_MODULE = "fedge_evil_mod"  # importing it writes EVIL_MARKER: proof that a client imported it
GOOD_DP = {"dp-clip-norm": 0.05, "dp-noise-std": 0.05, "dp-min-clients": 4}  # z = 2
WAIT = 300  # seconds per exchange: generous, a loaded machine starts Ray workers slowly
RESULTS: dict[str, Any] = {}


def contribution(pid: int) -> dict[str, np.ndarray]:
    """A small known contribution of partition ``pid``."""
    return {
        "delta/w": np.full(SIZE, 0.001 * (pid + 1), np.float32),
        "meta/weight": np.ones(1, np.float32),
        "meta/count": np.ones(1, np.float32),
    }


def train_loss(pid: int) -> float:
    """The train loss partition ``pid`` reports."""
    return 2.0 + pid


def train_content(**config: Any) -> RecordDict:
    return RecordDict({keys.REC_CONFIG: ConfigRecord({"weighting": "uniform", **config})})


def ddp(noise: float) -> DistributedDPAggregator:
    secagg = SecAggPlusAggregator(SecAggConfig(num_shares=1.0, stage_timeout_s=WAIT))
    cfg = DPConfig(mode="distributed", clip_norm=0.05, noise_multiplier=noise, min_survival=1.0)
    return DistributedDPAggregator(secagg, cfg)


Tamper = Callable[[str, dict[int, RecordDict]], None]


def tampered_round(grid: Grid, nodes: list[int], tamper: Tamper) -> dict[int, str]:
    """A SecAgg+ round over real messages whose requests ``tamper`` edits; return refusals."""
    engine = SecAggServerEngine(SecAggConfig(num_shares=1.0), nodes, "masked")
    config = train_content(**GOOD_DP)[keys.REC_CONFIG]
    errors: dict[int, str] = {}

    def exchange(stage: str, requests: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
        requests = dict(requests)
        tamper(stage, requests)
        messages = []
        for nid, req in requests.items():
            body = RecordDict(
                {keys.REC_CONFIG: config, wire.SECAGG_RECORD: req[wire.SECAGG_RECORD]}
            )
            messages.append(Message(body, dst_node_id=nid, message_type=MessageType.TRAIN))
        out = {}
        for reply in grid.send_and_receive(messages, timeout=WAIT):
            if reply.has_error():
                errors[reply.metadata.src_node_id] = reply.error.reason
            else:
                out[reply.metadata.src_node_id] = reply.content
        return out

    try:
        run_secagg(engine, exchange)
    except SecAggRoundFailed as exc:
        errors[-1] = str(exc)
    return errors


def half_threshold(stage: str, requests: dict[int, RecordDict]) -> None:
    """Send threshold 1 to nodes of 3 neighbours each: not more than half."""
    if stage == wire.STAGE_COLLECT:
        for req in requests.values():
            req[wire.SECAGG_RECORD][wire.KEY_THRESHOLD] = 1


def both_secrets(stage: str, requests: dict[int, RecordDict]) -> None:
    """Ask the first node for the self-mask share AND the pair seed of the second."""
    if stage == wire.STAGE_UNMASK:
        first, second = sorted(requests)[:2]
        requests[first][wire.SECAGG_RECORD][wire.KEY_DROPPED] = wire.pack_ids([second])


def main(grid: Grid) -> None:
    """Play every attack once, then an honest round; stash what came back."""
    nodes = sorted(partition_ids(grid, NUM_NODES))
    RESULTS["omit-secagg"] = PlainAggregator().aggregate(
        grid, 1, nodes, train_content(**GOOD_DP), SPEC, WAIT
    )
    RESULTS["low-noise"] = ddp(0.3).aggregate(grid, 2, nodes, train_content(), SPEC, WAIT)
    RESULTS["import"] = PlainAggregator().aggregate(
        grid, 3, nodes, train_content(**{keys.CFG_CLIENT_MODS: f"{EVIL_MODULE}:mod"}), SPEC, WAIT
    )
    RESULTS["half-threshold"] = tampered_round(grid, nodes, half_threshold)
    RESULTS["both-shares"] = tampered_round(grid, nodes, both_secrets)
    # z = 1.5 over 4 clients; each client counts only the 2 it can verify: 1.5 sqrt(2/4) >= 1
    RESULTS["honest"] = ddp(1.5).aggregate(grid, 4, nodes, train_content(), SPEC, WAIT)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the attacks once per module, with the policy and the marker module in place."""
    root = tmp_path_factory.mktemp("malicious")
    policy = root / "policy.toml"
    policy.write_text(POLICY)
    marker = root / "imported"
    (root / f"{EVIL_MODULE}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\n"
        "def mod(msg, context, call_next):\n    return call_next(msg, context)\n"
    )
    mp = pytest.MonkeyPatch()
    mp.setenv(POLICY_ENV, str(policy))
    mp.setenv(STATE_DIR_ENV, str(root / "node-state"))
    mp.syspath_prepend(str(root))
    try:
        simulate(main, known_client_app(contribution, train_loss), NUM_NODES)
    finally:
        mp.undo()
    return {**RESULTS, "marker": marker}


def refusals(result: Any) -> list[str]:
    return list(result.rejected.values())


def test_a_server_that_omits_secagg_gets_nothing(results: dict[str, Any]) -> None:
    result = results["omit-secagg"]
    assert result.summed is None and not result.accepted
    assert len(result.rejected) == NUM_NODES
    assert all("requires SecAgg+" in why for why in refusals(result))


def test_noise_below_the_policy_is_refused(results: dict[str, Any]) -> None:
    result = results["low-noise"]
    assert result.summed is None
    assert all("below this node's min-noise" in why for why in refusals(result))
    texts = [why.split("privacy policy:", 1)[1] for why in refusals(result)]
    assert not any(ch.isdigit() for text in texts for ch in text)  # no value: the rule only


def test_no_client_imports_a_module_a_message_names(results: dict[str, Any]) -> None:
    result = results["import"]
    assert result.summed is None
    assert all("not a registered mod" in why for why in refusals(result))
    assert not results["marker"].exists()


def test_a_threshold_of_half_the_neighbourhood_is_refused(results: dict[str, Any]) -> None:
    errors = results["half-threshold"]
    assert sum("not more than half" in why for why in errors.values()) == NUM_NODES
    assert "no aggregate is applied" in errors[-1]  # the round failed: nothing to unmask


def test_both_secrets_of_one_node_are_never_revealed(results: dict[str, Any]) -> None:
    errors = results["both-shares"]
    assert [why for why in errors.values() if "both live and dropped" in why]


def test_an_honest_round_under_the_same_policy_succeeds_and_hides_metrics(
    results: dict[str, Any],
) -> None:
    result = results["honest"]
    assert result.summed is not None and len(result.accepted) == NUM_NODES
    assert result.metrics == {}  # no client's own metrics reach the server
    # under distributed DP not even their un-noised sum: only the loss each mod noised
    assert set(result.summed_metrics) == {MET_DP_TRAIN_LOSS}
