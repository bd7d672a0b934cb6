"""The federated round loop, written once: sample, train, aggregate, finalize, evaluate, checkpoint.

Per round (numbered as in the code):
  1. ask the privacy budget whether this round may be released (else stop cleanly);
  2. sample, with the checkpointed RNG, from the nodes connected now, in partition order
     (:mod:`server.membership`: nodes join and leave during a run);
  3. hand the train message to the aggregator, which returns the SUM of valid
     contributions (malformed replies are rejected and logged with their node id);
  4. ``strategy.finalize`` turns the sum into the next global adapter and state;
  5. evaluate: server-side perplexity on the union of held-out splits, and the
     sampled clients' own held-out loss;
  6. write the metrics row and the checkpoint.
A round with fewer valid replies than ``min-train-nodes`` fails: the run stops with
``status.json`` saying why, its last checkpoint intact, resumable with ``--resume``.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedge import keys
from fedge.data.shards import device_pools
from fedge.lm import holder
from fedge.lm.evaluate import evaluate_tokens
from fedge.plugins import load_dotted
from fedge.privacy.wire import REFUSAL_BUDGET
from server.aggregation import AggregateResult, Aggregator, build_aggregator, reply_metrics
from server.budget import PrivacyBudget
from server.checkpoint import (
    Checkpoint,
    archive_previous_run,
    config_differences,
    latest_round,
    load_checkpoint,
    save_checkpoint,
)
from server.config import RunConfig
from server.membership import Roster
from server.privacy.factories import default_budget
from server.privacy.plots import dpsgd_epsilon, plot_privacy
from server.rundir import MetricsLog, plot_perplexity, write_config
from strategies.base import Arrays, ConfigValue, GlobalState, Strategy, replace_state
from strategies.registry import build_strategy

log = logging.getLogger(__name__)

RowCallback = Callable[[Mapping[str, Any]], None]
NODE_WAIT_SECONDS = (
    300.0  # first nodes: a Ray engine starting on a busy 2-core machine took over 120 s
)


@dataclass(frozen=True)
class LoopOutcome:
    """How a run ended: ``completed``, ``budget`` (privacy budget spent) or ``failed``."""

    status: str
    message: str
    run_dir: Path
    state: GlobalState | None
    adapter_dir: Path | None


def default_run_dir() -> Path:
    """``runs/flwr-<UTC time>`` under the working directory (used when ``run-dir`` is empty)."""
    return Path("runs") / datetime.now(UTC).strftime("flwr-%Y%m%d-%H%M%S")


def build_budget(cfg: RunConfig, aggregator: Aggregator) -> PrivacyBudget:
    """The accountant named by ``privacy-budget`` (a dotted factory), else the aggregator's own."""
    if not cfg.privacy_budget:
        return default_budget(cfg, aggregator)
    return load_dotted(cfg.privacy_budget, what="config key 'privacy-budget'")(cfg)  # type: ignore[return-value]


class ServerModel:
    """The server's copy of base + LoRA: initial adapter, held-out perplexity, final export."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.model_path = holder.resolve_model(cfg.model)
        self.client_config = client_config(cfg)
        self.lm = holder.get_lora_model(self.model_path, cfg.train)
        self._heldout: dict[tuple[int, ...] | None, np.ndarray] = {}

    def initial_adapter(self) -> Arrays:
        """The seeded LoRA initialisation (B = 0, so the model starts as the base model)."""
        return {k: v.copy() for k, v in self.lm.initial.items()}

    def heldout(self, partitions: Sequence[int] | None = None) -> np.ndarray:
        """The held-out tokens of the given partitions (default: every client), built once."""
        key = tuple(partitions) if partitions is not None else None
        if key not in self._heldout:
            corpus = holder.get_corpus(self.client_config)
            if key is None:
                self._heldout[key] = np.asarray(corpus.heldout_union())
            else:
                streams = [np.asarray(corpus.client(p).heldout) for p in key]
                self._heldout[key] = np.concatenate(streams) if streams else np.zeros(0, np.int64)
        return self._heldout[key]

    def evaluate(self, adapter: Arrays, partitions: Sequence[int] | None = None) -> float:
        """Mean token loss of base + ``adapter`` on evenly spaced held-out windows.

        ``partitions`` limits the held-out data to those clients' (the participants');
        by default every client's held-out split is used (the whole corpus). NaN when the
        participants hold no held-out text (small packages can have none): nothing to score.
        """
        tokens = self.heldout(partitions)
        if partitions is not None and len(tokens) < 2:
            return math.nan
        holder.set_adapter(self.lm, adapter)
        cfg = self.cfg.train
        eval_cfg = type(cfg).from_config(
            {**cfg.to_config(), "eval-batches": self.cfg.server_eval_batches}
        )
        loss, _ = evaluate_tokens(self.lm.model, tokens, eval_cfg, self.lm.device)
        return loss

    def export(self, adapter: Arrays, out: Path) -> Path:
        """Save the adapter in peft format and, if configured, a merged model with its tokenizer."""
        from peft import PeftModel

        from fedge.models import load_causal_lm, load_tokenizer

        holder.set_adapter(self.lm, adapter)
        adapter_dir = out / "adapter"
        self.lm.model.save_pretrained(str(adapter_dir))  # type: ignore[operator]
        if self.cfg.save_merged:
            path = self.model_path
            merged = PeftModel.from_pretrained(
                load_causal_lm(path), str(adapter_dir)
            ).merge_and_unload()
            merged.save_pretrained(str(out / "merged"))  # type: ignore[operator]
            load_tokenizer(path).save_pretrained(str(out / "merged"))
        return adapter_dir


# ---------------------------------------------------------------- messages
def client_config(cfg: RunConfig) -> dict[str, ConfigValue]:
    """The run's client config plus the server's resolved model dir (saves clients a zoo check)."""
    return {**cfg.client_config(), keys.CFG_MODEL_PATH: holder.resolve_model(cfg.model)}


def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """numpy arrays -> ArrayRecord (contiguous float32 copies are what clients expect)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def train_content(
    state: GlobalState,
    strategy: Strategy,
    cfg: RunConfig,
    server_round: int,
    target: int = 0,
    committed: Mapping[int, int] | None = None,
) -> RecordDict:
    """The train message: global adapter, strategy record, and the full client config.

    ``target`` (K, the reports the round wants) rides along for Grid wrappers that close a
    round at the first K reports (the simulated devices' grid); clients ignore it.
    ``committed`` (partition -> last accepted round) tells each sampled client which of
    its saved states the server's aggregate actually contains.
    """
    config: dict[str, Any] = {
        **client_config(cfg),
        **strategy.client_config(server_round),
        keys.CFG_SERVER_ROUND: server_round,
        keys.CFG_TARGET_REPORTS: target,
    }
    if committed is not None:
        parts = sorted(committed)
        config[keys.CFG_COMMITTED_PARTITIONS] = parts
        config[keys.CFG_COMMITTED_ROUNDS] = [committed[p] for p in parts]
    return RecordDict(
        {
            keys.REC_GLOBAL: to_array_record(state.adapter),
            keys.REC_STRATEGY: to_array_record(strategy.client_payload(state)),
            keys.REC_CONFIG: ConfigRecord(config),  # type: ignore[arg-type]
        }
    )


def query_partitions(grid: Grid, nodes: Sequence[int], cfg: RunConfig) -> dict[int, int]:
    """Ask every node for its partition id; nodes that do not answer are left out."""
    content = RecordDict({keys.REC_CONFIG: ConfigRecord(client_config(cfg))})  # type: ignore[arg-type]
    messages = [
        Message(content, dst_node_id=n, message_type=MessageType.QUERY, group_id="0") for n in nodes
    ]
    out: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=min(NODE_WAIT_SECONDS, cfg.round_timeout)):
        if reply.has_error():
            log.warning(
                "node %d failed the partition query: %s",
                reply.metadata.src_node_id,
                reply.error.reason,
            )
            continue
        metrics = reply_metrics(reply)
        if keys.MET_PARTITION in metrics:
            out[reply.metadata.src_node_id] = int(metrics[keys.MET_PARTITION])
    return out


def sample_nodes(
    rng: np.random.Generator, candidates: Sequence[int], population: int, cfg: RunConfig
) -> tuple[int, list[int]]:
    """Return (K, sampled): K reports wanted (``target-reports``, else max(min-train-nodes,
    ceil(fraction-train * population))) and ceil(K * (1 + over-selection)) of the connected
    ``candidates``, in their order."""
    wanted = cfg.target_reports or max(
        cfg.min_train_nodes, math.ceil(cfg.fraction_train * population)
    )
    target = min(len(candidates), wanted)
    n = min(len(candidates), math.ceil(target * (1.0 + cfg.over_selection)))
    picks = sorted(int(i) for i in rng.choice(len(candidates), size=n, replace=False))
    return target, [candidates[i] for i in picks]


def resolve_partition_count(cfg: RunConfig, population: int) -> RunConfig:
    """``num-partitions = 0`` under iid or dirichlet means one partition per connected node, at
    most one per document: more nodes than that train on shards (:mod:`fedge.data.shards`)."""
    if cfg.partition_scheme == "natural" or cfg.num_partitions > 0:
        return cfg
    from fedge.data import load_documents

    source = Path(cfg.data_source) if cfg.data_source else None
    documents = len(load_documents(source, cfg.max_chars_per_client or None))
    return cfg.with_overrides({keys.CFG_NUM_PARTITIONS: min(population, documents)})


def client_evaluate(
    grid: Grid, nodes: Sequence[int], state: GlobalState, cfg: RunConfig, server_round: int
) -> float:
    """Example-weighted mean of the clients' held-out losses (NaN when none answered)."""
    content = RecordDict(
        {
            keys.REC_GLOBAL: to_array_record(state.adapter),
            keys.REC_CONFIG: ConfigRecord(
                {**client_config(cfg), keys.CFG_SERVER_ROUND: server_round}
            ),  # type: ignore[arg-type]
        }
    )
    messages = [
        Message(
            content, dst_node_id=n, message_type=MessageType.EVALUATE, group_id=str(server_round)
        )
        for n in nodes
    ]
    total, weight = 0.0, 0.0
    for reply in grid.send_and_receive(messages, timeout=cfg.round_timeout):
        if reply.has_error():
            log.warning(
                "round %d: node %d failed to evaluate: %s",
                server_round,
                reply.metadata.src_node_id,
                reply.error.reason,
            )
            continue
        m = reply_metrics(reply)
        if math.isfinite(m.get(keys.MET_EVAL_LOSS, math.nan)):
            total += m[keys.MET_EVAL_LOSS] * m.get(keys.MET_NUM_EXAMPLES, 1.0)
            weight += m.get(keys.MET_NUM_EXAMPLES, 1.0)
    return total / weight if weight else math.nan


# ---------------------------------------------------------------- the loop
def run_federation(
    grid: Grid, cfg: RunConfig, resume: bool = False, on_row: RowCallback | None = None
) -> LoopOutcome:
    """Run (or resume) the configured federation on ``grid``; always leaves status.json behind."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir()
    try:
        return _run(grid, cfg, run_dir, resume, on_row or (lambda _row: None))
    except Exception as exc:
        _write_status(run_dir, "failed", f"{type(exc).__name__}: {exc}")
        raise


def _run(
    grid: Grid, cfg: RunConfig, run_dir: Path, resume: bool, on_row: RowCallback
) -> LoopOutcome:
    strategy = build_strategy(cfg.to_mapping())
    aggregator = build_aggregator(cfg.aggregator, cfg)
    budget = build_budget(cfg, aggregator)

    # Connect: wait for nodes and learn their partitions (node ids change across restarts;
    # partitions key the restart-proof sampling order and the clients' committed state).
    roster = Roster(lambda g, nodes: query_partitions(g, nodes, cfg))
    roster.refresh(grid, cfg.min_available_nodes, NODE_WAIT_SECONDS)
    partitions = roster.partitions  # connected node -> partition, kept current by refresh()
    cfg = resolve_partition_count(cfg, roster.partitions_seen)
    # held-out data of the nodes at the start (devices beyond the partitions: their pools)
    participants = device_pools(holder.get_corpus(client_config(cfg)), partitions.values())

    # Start fresh or resume from the newest checkpoint (refused when the config changed).
    last = latest_round(run_dir) if resume else None
    ckpt = load_checkpoint(run_dir, last) if last is not None else None
    if ckpt is not None:
        _check_resumable(ckpt, cfg, strategy, run_dir)
    elif (archived := archive_previous_run(run_dir)) is not None:
        log.info("a fresh run in %s: the earlier run's outputs moved to %s", run_dir, archived)
    run_id = ckpt.run_id if ckpt is not None and ckpt.run_id else cfg.run_id or secrets.token_hex(8)
    cfg = cfg.with_overrides({keys.CFG_RUN_ID: run_id})
    server_model = ServerModel(cfg)
    write_config(run_dir, cfg.to_mapping())
    metrics = MetricsLog(run_dir)
    _write_status(run_dir, "running", "")

    rng = np.random.default_rng(cfg.seed)
    committed: dict[int, int] = {}
    if ckpt is not None and last is not None:
        state = ckpt.state
        rng.bit_generator.state = ckpt.rng_state
        budget.load_state(ckpt.budget_state)
        committed = dict(ckpt.committed)
        metrics.truncate_after(last)
        log.info("resuming %s from round %d", run_dir, last)
    else:
        adapter = server_model.initial_adapter()
        state = GlobalState(adapter, strategy.init_extras(adapter), 0)
        metrics.truncate_after(-1)
        loss = server_model.evaluate(state.adapter)
        part_loss = server_model.evaluate(state.adapter, participants)
        row = _row(
            0,
            "ok",
            strategy,
            loss=loss,
            part_loss=part_loss,
            sampled=0,
            epsilon=budget.epsilon(),
            budget=budget,
        )
        metrics.append(row)
        on_row(row)
        _checkpoint(run_dir, state, rng, budget, strategy, cfg, committed)

    status, message = "completed", f"{cfg.num_server_rounds} rounds done"
    for server_round in range(state.server_round + 1, cfg.num_server_rounds + 1):
        # 1. Privacy budget
        if cfg.max_epsilon > 0 and not budget.allows(server_round):
            status = "budget"
            message = f"stopped before round {server_round}: it would exceed max-epsilon={cfg.max_epsilon} (spent {budget.epsilon():.3f})"
            break
        # 2. Sample K (1 + over-selection) of the nodes connected now (nodes join and leave)
        t0 = time.perf_counter()
        candidates = roster.refresh(grid, 0, cfg.round_timeout)
        population = roster.partitions_seen  # every client seen so far
        target, sampled = sample_nodes(rng, candidates, population, cfg)
        # 3. Train and aggregate
        content = train_content(
            state,
            strategy,
            cfg,
            server_round,
            target,
            {partitions[n]: committed.get(partitions[n], 0) for n in sampled},
        )
        t_train = time.perf_counter()
        result = aggregator.aggregate(
            grid,
            server_round,
            sampled,
            content,
            strategy.contribution_spec(state),
            cfg.round_timeout,
        )
        train_phase = time.perf_counter() - t_train
        if result.summed is None or len(result.accepted) < cfg.min_train_nodes:
            if _budget_spent(result.rejected):
                status = "budget"
                message = (
                    f"stopped at round {server_round}: the sampled clients refused to train, their "
                    f"own privacy budgets spent ({_describe(result.rejected)})"
                )
                break
            message = (
                f"round {server_round} failed: {len(result.accepted)} of {len(sampled)} sampled clients "
                f"returned valid updates, min-train-nodes is {cfg.min_train_nodes}; rejected: "
                f"{_describe(result.rejected)}. The run is checkpointed at round {state.server_round}: "
                f"fix the cause and continue with `fedge simulate --resume {run_dir}`"
            )
            row = _row(
                server_round,
                "failed",
                strategy,
                sampled=len(sampled),
                result=result,
                seconds=time.perf_counter() - t0,
                connected=len(candidates),
            )
            metrics.append(row)
            on_row(row)
            _write_status(run_dir, "failed", message)
            return LoopOutcome("failed", message, run_dir, state, None)
        # 4. Finalize (a round where every client's work was dropped leaves the adapter as is)
        if float(result.summed[keys.KEY_WEIGHT][0]) > 0:
            state = strategy.finalize(state, result.summed, population)
            row_status = "ok"
        else:
            state = replace_state(state, server_round=server_round)
            row_status = "empty"
        budget.record(server_round, len(sampled), population)
        committed.update({partitions[n]: server_round for n in result.accepted if n in partitions})
        # 5. Evaluate: the whole corpus and the participating clients' own held-out data
        loss = server_model.evaluate(state.adapter)
        part_loss = server_model.evaluate(state.adapter, participants)
        client_loss = (
            client_evaluate(grid, sampled, state, cfg, server_round)
            if cfg.client_eval
            else math.nan
        )
        # 6. Metrics and checkpoint
        row = _row(
            server_round,
            row_status,
            strategy,
            loss=loss,
            part_loss=part_loss,
            client_loss=client_loss,
            sampled=len(sampled),
            result=result,
            seconds=time.perf_counter() - t0,
            epsilon=budget.epsilon(),
            budget=budget,
            train_phase=train_phase,
            connected=len(candidates),
        )
        metrics.append(row)
        _checkpoint(run_dir, state, rng, budget, strategy, cfg, committed)
        on_row(row)

    plot_perplexity({strategy.name: metrics.rows()}, run_dir / "perplexity.png")
    plot_privacy(metrics.rows(), run_dir / "privacy.png")
    adapter_dir = server_model.export(state.adapter, run_dir / "final")
    _write_status(run_dir, status, message)
    return LoopOutcome(status, message, run_dir, state, adapter_dir)


def _checkpoint(
    run_dir: Path,
    state: GlobalState,
    rng: np.random.Generator,
    budget: PrivacyBudget,
    strategy: Strategy,
    cfg: RunConfig,
    committed: Mapping[int, int],
) -> None:
    save_checkpoint(
        run_dir,
        Checkpoint(
            state,
            dict(rng.bit_generator.state),
            budget.state(),
            strategy.name,
            cfg.run_id,
            dict(cfg.to_mapping()),
            dict(committed),
        ),
    )


def _budget_spent(rejected: Mapping[int, str]) -> bool:
    """Whether every refusal of a failed round is a client's exhausted privacy budget."""
    return bool(rejected) and all(REFUSAL_BUDGET in why for why in rejected.values())


def _check_resumable(ckpt: Checkpoint, cfg: RunConfig, strategy: Strategy, run_dir: Path) -> None:
    """Refuse to resume a checkpoint made by another strategy or config, naming the difference."""
    saved = {k: v for k, v in ckpt.config.items() if k != keys.CFG_RUN_ID}
    current = {k: v for k, v in cfg.to_mapping().items() if k != keys.CFG_RUN_ID}
    differences = config_differences(saved, current) if saved else []
    if ckpt.strategy != strategy.name and not differences:
        differences = [
            f"strategy: checkpoint has {ckpt.strategy!r}, this run has {strategy.name!r}"
        ]
    if differences:
        raise ValueError(
            f"--resume refused: the checkpoint of round {ckpt.state.server_round} in {run_dir} "
            f"was made with another config ({'; '.join(differences)}). Resume with the same "
            "config, or start a new run in another directory"
        )


def _describe(rejected: Mapping[int, str]) -> str:
    if not rejected:
        return "none"
    return "; ".join(f"node {n}: {why}" for n, why in sorted(rejected.items()))


def _row(
    server_round: int,
    status: str,
    strategy: Strategy,
    loss: float = math.nan,
    part_loss: float = math.nan,
    client_loss: float = math.nan,
    sampled: int = 0,
    result: AggregateResult | None = None,
    seconds: float = 0.0,
    epsilon: float = 0.0,
    budget: PrivacyBudget | None = None,
    train_phase: float = 0.0,
    connected: int = 0,
) -> dict[str, Any]:
    """One metrics row (NaN becomes null in JSON)."""
    per_client = _per_client_metrics(result)
    counted = float(result.summed[keys.KEY_COUNT][0]) if result and result.summed else 0.0
    train_losses = [m[keys.MET_TRAIN_LOSS] for m in per_client if keys.MET_TRAIN_LOSS in m]
    train_secs = [m.get(keys.MET_TRAIN_SECONDS, 0.0) for m in per_client]
    return {
        "round": server_round,
        "status": status,
        "strategy": strategy.name,
        "train_loss": _num(float(np.mean(train_losses)) if train_losses else math.nan),
        "eval_loss": _num(loss),
        "perplexity": _num(math.exp(loss) if math.isfinite(loss) else math.nan),
        "participants_eval_loss": _num(part_loss),
        "participants_perplexity": _num(
            math.exp(part_loss) if math.isfinite(part_loss) else math.nan
        ),
        "client_eval_loss": _num(client_loss),
        "clients_connected": connected,
        "clients_sampled": sampled,
        "partitions_trained": sorted(
            int(m[keys.MET_PARTITION]) for m in per_client if keys.MET_PARTITION in m
        ),
        "clients_succeeded": len(result.accepted) if result else 0,
        "clients_rejected": len(result.rejected) if result else 0,
        "clients_dropped": (len(result.accepted) - round(counted))
        if result and result.summed
        else 0,
        "bytes_up": result.bytes_up if result else 0,
        "bytes_down": result.bytes_down if result else 0,
        "round_seconds": round(seconds, 4),
        "train_phase_seconds": round(train_phase, 4),
        "train_seconds_max": round(max(train_secs), 4) if train_secs else 0.0,
        "train_seconds_sum": round(sum(train_secs), 4),
        "epsilon": epsilon,
        "epsilon_accountant": getattr(budget, "method", None),  # rdp | pld | None (no DP)
        "dp_sgd_epsilon": _num(dpsgd_epsilon(per_client)),
        "model_loads_max": max((m.get(keys.MET_MODEL_LOADS, 0.0) for m in per_client), default=0.0),
        "worker_calls_max": max((m.get(keys.MET_CALLS, 0.0) for m in per_client), default=0.0),
        "rejected": {str(n): why for n, why in sorted(result.rejected.items())} if result else {},
    }


def _per_client_metrics(result: AggregateResult | None) -> list[dict[str, float]]:
    """Each accepted client's metrics; under SecAgg+, where only their sum reached the server,
    every accepted client is given the mean (so means and sums are right, maxima are means)."""
    if result is None:
        return []
    if result.metrics or not result.summed_metrics or not result.accepted:
        return list(result.metrics.values())
    mean = {k: v / len(result.accepted) for k, v in result.summed_metrics.items()}
    return [mean] * len(result.accepted)


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _write_status(run_dir: Path, status: str, message: str) -> None:
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"status": status, "message": message}) + "\n")
