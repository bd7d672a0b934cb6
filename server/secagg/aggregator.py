"""SecAgg+ as a round-loop aggregator: the protocol stages as Flower Message-API exchanges."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.privacy.ffa import ffa_enabled, frozen_keys
from fedge.secagg import wire
from fedge.secagg.config import SecAggConfig
from fedge.secagg.vectors import scale_for
from fedge.server.aggregation import AggregateResult, ContributionSpec, record_dict_bytes
from fedge.server.grid import exchange_messages
from fedge.server.secagg.engine import KeyBook, SecAggRoundFailed, SecAggServerEngine
from fedge.server.secagg.protocol import run_secagg
from fedge.strategies.robust import RobustConfig, aggregate_problem

log = logging.getLogger(__name__)

# ArrayRecord in which the client mod returns its masked contribution.
MASKED_RECORD = "fedge.secagg.masked"
# The registered client mod every SecAgg+ run needs (fedge.clients.mods.REGISTRY).
CLIENT_MOD = "secagg"
# A client refusal that means it holds no keys of this session (restarted): re-advertise.
_LOST_KEYS = "advertise keys"


class SecAggPlusAggregator:
    """Sum the round's contributions under SecAgg+ so the server sees only the sum.

    Keys are advertised once per run (this object's :class:`KeyBook`); each round is then
    two exchanges, collect (the strategy's train content plus the protocol record) and
    unmask (to the holders the thresholds need; a second unmask exchange asks the others
    only if some of those stay silent). Each stage waits at most ``cfg.stage_timeout_s`` (collect, which trains, at
    most the loop's timeout when that is longer). When too few clients answer, the round
    fails: ``summed`` is None. Clients' metrics arrive only as their sum. A sum that could
    not be this many clipped contributions (``bounds``: weight and update norm, checked by
    :meth:`check_bounds`) is returned with ``out_of_bounds`` saying why; the loop keeps the
    previous global model.
    """

    def __init__(self, cfg: SecAggConfig | None = None, bounds: RobustConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else SecAggConfig()
        self.bounds = bounds if bounds is not None else RobustConfig()
        self.keys = KeyBook()
        self.last_failure: str | None = None
        self.min_contributors: int | None = None  # per-round override, set by distributed DP
        self.last_stage_seconds: dict[str, float] = {}  # wall time of each stage, last round

    def aggregate(
        self,
        grid: Grid,
        server_round: int,
        node_ids: Sequence[int],
        content: RecordDict,
        spec: ContributionSpec,
        timeout: float | None,
    ) -> AggregateResult:
        """Run the SecAgg+ stages over ``node_ids`` and return the unmasked sum."""
        result = AggregateResult(summed=None)
        self.last_failure = None
        self.last_stage_seconds = {}
        content = with_secagg_mod(content)

        def exchange(stage: str, requests: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
            messages = [
                Message(
                    _stage_content(stage, content, req),
                    dst_node_id=nid,
                    message_type=MessageType.TRAIN,
                    group_id=f"{server_round}",
                )
                for nid, req in requests.items()
            ]
            started = time.perf_counter()
            wait = self.cfg.stage_timeout_s
            if stage == wire.STAGE_COLLECT and timeout is not None:
                wait = max(wait, timeout)
            out: dict[int, RecordDict] = {}
            for msg in exchange_messages(grid, messages, wait):
                nid = msg.metadata.src_node_id
                if msg.has_error():
                    result.rejected[nid] = (
                        f"{stage}: client error {msg.error.code}: {msg.error.reason}"
                    )
                    log.warning("round %d: node %d %s", server_round, nid, result.rejected[nid])
                    if _LOST_KEYS in str(msg.error.reason):
                        self.keys.forget([nid])
                    continue
                out[nid] = msg.content
                result.bytes_up += record_dict_bytes(msg.content)
            result.bytes_down += sum(record_dict_bytes(m.content) for m in messages)
            self.last_stage_seconds[stage] = time.perf_counter() - started
            return out

        config = content.config_records.get(keys.REC_CONFIG, ConfigRecord())
        omit = frozen_keys(spec) if ffa_enabled(config) else []
        try:
            engine = SecAggServerEngine(
                self.cfg,
                node_ids,
                MASKED_RECORD,
                expected=spec,
                min_contributors=self.min_contributors,
                omit_zero=omit,
                keys=self.keys,
            )
            summed = run_secagg(engine, exchange)
        except SecAggRoundFailed as exc:
            self.last_failure = result.failure = f"round {server_round}: {exc}"
            log.error("%s", self.last_failure)
            for nid in node_ids:
                result.rejected.setdefault(nid, str(exc))
            return result
        result.accepted = engine.contributors
        for nid in set(node_ids) - set(engine.contributors):
            result.rejected.setdefault(nid, "dropped out of the SecAgg+ round")
        for name in omit:  # FFA-LoRA keys every client left out: exactly zero
            summed[name] = np.zeros(spec[name], dtype=np.float32)
        result.summed_metrics = {
            k[len(wire.PREFIX_METRIC) :]: float(v[0])
            for k, v in summed.items()
            if k.startswith(wire.PREFIX_METRIC)
        }
        result.summed = {
            k: v.astype("float32")
            for k, v in summed.items()
            if not k.startswith(wire.PREFIX_METRIC)
        }
        result.out_of_bounds = self.check_bounds(result.summed, len(engine.contributors))
        if result.out_of_bounds is not None:
            log.warning("round %d: aggregate rejected: %s", server_round, result.out_of_bounds)
        return result

    def check_bounds(self, summed: Mapping[str, np.ndarray], contributors: int) -> str | None:
        """Why the unmasked sum cannot be ``contributors`` clipped contributions (None if it can).

        The weight bound is ``max-client-weight``, else the largest weight an honest client can
        encode (clipping range x its scale); the slack is the quantizer's error, at most
        2R/levels per value and client (times the largest scale).
        """
        weight_range = self.cfg.clipping_range * scale_for(
            keys.KEY_WEIGHT, dict(self.cfg.key_scales)
        )
        bounds = replace(self.bounds, max_weight=self.bounds.max_weight or weight_range)
        largest = max([1.0, *(scale for _, scale in self.cfg.key_scales)])
        per_value = 2 * self.cfg.clipping_range / self.cfg.quantization_range * largest
        size = sum(v.size for v in summed.values())
        slack = contributors * per_value * max(1.0, float(np.sqrt(size)))
        return aggregate_problem(dict(summed), contributors, bounds, slack)


def _stage_content(stage: str, content: RecordDict, request: RecordDict) -> RecordDict:
    """One stage message: the protocol record, the run config, and at collect the train content."""
    body = RecordDict()
    if stage == wire.STAGE_COLLECT:
        for name, record in content.items():
            body[name] = record
    elif keys.REC_CONFIG in content.config_records:
        body[keys.REC_CONFIG] = content.config_records[keys.REC_CONFIG]
    for name, record in request.items():
        body[name] = record
    return body


def with_secagg_mod(content: RecordDict) -> RecordDict:
    """Copy ``content`` with the SecAgg+ client mod first (outermost) in ``client-mods``."""
    out = RecordDict()
    for name, record in content.items():
        out[name] = record
    config = ConfigRecord(dict(content.config_records.get(keys.REC_CONFIG, ConfigRecord())))
    mods = [m.strip() for m in str(config.get(keys.CFG_CLIENT_MODS, "")).split(",") if m.strip()]
    config[keys.CFG_CLIENT_MODS] = ",".join([CLIENT_MOD, *(m for m in mods if m != CLIENT_MOD)])
    out[keys.REC_CONFIG] = config
    return out
