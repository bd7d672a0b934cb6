"""One ``train`` or ``evaluate`` call of the ClientApp: LoRA steps or held-out loss on this node's data.

:mod:`fedge.clients.app` hands these calls here, so torch, transformers and peft load with a node's
first training or evaluation, never for a ``query`` (a node that only reports its partition
starts in a fraction of the time).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict

from fedge import keys, names
from fedge.clients.node import local_config, partition_id
from fedge.clients.privacy.ledger import node_ledger
from fedge.clients.privacy.local import (
    ERROR_BUDGET,
    BudgetExhausted,
    apply_ffa,
    dpsgd_config,
    ffa_enabled,
    train_dpsgd_round,
)
from fedge.clients.privacy.policy import dpsgd_budget, node_policy
from fedge.clients.state import CommittedStore, ContextStore, DiskStore
from fedge.clients.trainer import (
    build_optimizer,
    random_windows,
    resolve_optimizer,
    run_local_steps,
)
from fedge.data import ClientTokens
from fedge.data.shards import device_tokens
from fedge.lm import distill, holder
from fedge.lm.bos import model_bos_token_id
from fedge.lm.config import TrainConfig, derive_seed
from fedge.lm.evaluate import autocast_context, evaluate_tokens
from fedge.strategies.base import (
    Arrays,
    ClientResult,
    ClientStateStore,
    ConfigValue,
    Weighting,
    build_contribution,
)
from fedge.strategies.registry import build_strategy


def device_data(
    config: Mapping[str, ConfigValue], context: Context, cfg: TrainConfig
) -> ClientTokens:
    """This node's data: its partition, or a shard of the partitions when the population
    (node config ``num-partitions``) outnumbers them (:mod:`fedge.data.shards`)."""
    corpus = holder.get_corpus(config)
    population = int(context.node_config.get(keys.NODE_NUM_PARTITIONS, len(corpus)))
    return device_tokens(corpus, partition_id(context), population, cfg.seq_len + 1)


def record_arrays(msg: Message, name: str) -> Arrays:
    """Return an ArrayRecord of the message as numpy arrays (empty when absent)."""
    if name not in msg.content.array_records:
        return {}
    return {k: v.numpy() for k, v in msg.content.array_records[name].items()}


def state_store(config: Mapping[str, ConfigValue], context: Context, pid: int) -> ClientStateStore:
    """Where this client's strategy state lives, seen through the server's acceptances.

    Disk under ``<state-root>/<client-state-dir>/<run-id>`` when the server names a
    ``client-state-dir`` (survives restarts; a new run never sees an earlier run's state;
    the root is this node's, :func:`fedge.names.resolve_state`), else the node Context.
    """
    run_id = str(config.get(keys.CFG_RUN_ID, "")) or "unnamed-run"
    where = names.resolve_state(
        str(config.get(keys.CFG_CLIENT_STATE_DIR, "")), run_id, context.node_config
    )
    inner = (
        DiskStore(where / f"partition_{pid:04d}")
        if where is not None
        else ContextStore(context.state)
    )
    committed = committed_round(config, pid)
    return inner if committed is None else CommittedStore(inner, committed)


def committed_round(config: Mapping[str, ConfigValue], pid: int) -> int | None:
    """The last round whose contribution from partition ``pid`` the server accepted.

    None when the message carries no acceptances (a server that does not track them);
    0 when this partition has no accepted contribution yet.
    """
    parts = config.get(keys.CFG_COMMITTED_PARTITIONS)
    rounds = config.get(keys.CFG_COMMITTED_ROUNDS)
    if not isinstance(parts, list) or not isinstance(rounds, list) or len(parts) != len(rounds):
        return None
    return int(dict(zip(parts, rounds, strict=True)).get(pid, 0))


def step_budget(config: Mapping[str, ConfigValue], local_steps: int) -> int:
    """Steps to run this round: ``local-steps``, capped by a ``step-budget`` the device set."""
    budget = int(config.get(keys.CFG_STEP_BUDGET, 0))
    if budget < 0:
        raise ValueError(f"config key '{keys.CFG_STEP_BUDGET}' must be >= 0, got {budget}")
    return min(local_steps, budget) if budget > 0 else local_steps


def _cache_metrics() -> dict[str, float]:
    return {
        keys.MET_MODEL_LOADS: float(holder.STATS["model_loads"]),
        keys.MET_CALLS: float(holder.STATS["calls"]),
    }


def train_reply(msg: Message, context: Context) -> Message:
    """Run local LoRA training on this node's partition and reply with the contribution."""
    t0 = time.perf_counter()
    holder.STATS["calls"] += 1
    config = local_config(msg, context)
    cfg = TrainConfig.from_config(config)
    holder.configure_threads(cfg.client_threads)
    pid = partition_id(context)
    seed = int(config.get(keys.CFG_SEED, 0))
    server_round = int(config.get(keys.CFG_SERVER_ROUND, 1))
    lm = holder.get_lora_model(holder.client_model_ref(config), cfg)
    global_adapter = record_arrays(msg, keys.REC_GLOBAL)
    holder.set_adapter(lm, global_adapter)
    tokens = device_data(config, context, cfg).train
    bos = model_bos_token_id(holder.resolve_model(holder.client_model_ref(config)))

    # Strategy hook, then the local loop: everything random is seeded by (seed, round, partition),
    # except DP-SGD's batches and noise, which must be secret and come from the OS.
    strategy = build_strategy(config)
    anchor = {k: p.detach().clone() for k, p in lm.params.items()}
    hook = strategy.client_hook(
        config, anchor, record_arrays(msg, keys.REC_STRATEGY), state_store(config, context, pid)
    )
    steps = step_budget(config, cfg.local_steps)
    completed = steps / cfg.local_steps
    rng = np.random.default_rng(derive_seed(seed, "batches", server_round, pid))
    torch.manual_seed(derive_seed(seed, "torch", server_round, pid))
    batches = [
        random_windows(tokens, cfg.batch_size, cfg.seq_len, rng, bos).to(lm.device)
        for _ in range(steps)
    ]
    apply_ffa(
        lm.model, ffa_enabled(config)
    )  # FFA-LoRA: lora_A frozen under DP (fedge.clients.privacy)
    dp = dpsgd_config(config)
    t_train = time.perf_counter()
    privacy_metrics: dict[str, float] = {}
    if dp is not None:  # sample-level DP-SGD with Opacus, noise from the OS (fedge.clients.privacy)
        distill.refuse_dpsgd(config)
        if str(config.get(keys.CFG_DATA_KIND, "text")) != "text":
            raise ValueError(
                f"DP-SGD trains on text streams; with {keys.CFG_DATA_KIND}=instructions use "
                "distributed DP under SecAgg+ (aggregator secagg_distributed_dp)"
            )
        try:
            losses, privacy_metrics = train_dpsgd_round(
                lm.model,
                np.asarray(tokens),
                dp=dp,
                steps=steps,
                batch_size=cfg.batch_size,
                seq_len=cfg.seq_len,
                lr=cfg.lr,
                hook=hook,
                ledger=node_ledger(context),
                max_epsilon=dpsgd_budget(node_policy(context.node_config), config),
                bos=bos,
            )
        except BudgetExhausted as exc:  # this client stops contributing, the server hears why
            return Message(Error(code=ERROR_BUDGET, reason=str(exc)), reply_to=msg)
    else:
        model, optimizer = build_optimizer(
            lm.model,
            list(lm.params.values()),
            cfg,
            resolve_optimizer(cfg, strategy.local_optimizer),
        )
        model.train()
        loss_fn = distill.batch_loss(config)  # next-token CE, or KL to `distill-teacher`
        batches = distill.teacher_batches(config, batches)  # realignment: the teacher's own paths
        losses = run_local_steps(
            lm.params,
            lambda step: loss_fn(model, batches[step]),
            steps,
            optimizer,
            hook,
            cfg.max_grad_norm,
            autocast_context(lm.device, cfg.precision),
        )
    train_seconds = time.perf_counter() - t_train

    # Contribution: delta = local - global; the hook adds its extras and state.
    local = holder.adapter_arrays(lm)
    delta = {k: local[k] - global_adapter[k] for k in local}
    extras, new_state = hook.finish(delta, steps, cfg.lr)
    # FedAvg's n_k: the client's training examples (seq-len windows of its train split), not the
    # samples this round happened to draw, so a tiny partition weighs little.
    num_examples = max(1, len(tokens) // cfg.seq_len)
    weighting: Weighting = "uniform" if config.get(keys.CFG_WEIGHTING) == "uniform" else "examples"
    contribution = build_contribution(
        ClientResult(delta, num_examples, completed, extras),
        weighting,
        bool(config.get(keys.CFG_ACCEPT_PARTIAL, False)),
    )
    if new_state is not None and contribution[keys.KEY_COUNT][0] > 0:
        state_store(config, context, pid).save(server_round, new_state)
    metrics = MetricRecord(
        {
            # under DP-SGD the loss leaves only noised and accounted (privacy_metrics)
            **({keys.MET_TRAIN_LOSS: float(np.mean(losses))} if dp is None else {}),
            keys.MET_NUM_EXAMPLES: num_examples,
            keys.MET_LOCAL_STEPS: steps,
            keys.MET_COMPLETED: completed,
            keys.MET_TRAIN_SECONDS: train_seconds,
            keys.MET_PARTITION: pid,
            "client-seconds": time.perf_counter() - t0,
            **_cache_metrics(),
            **privacy_metrics,
        }
    )
    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in contribution.items()})
    return Message(RecordDict({keys.REC_CONTRIB: record, keys.REC_METRICS: metrics}), reply_to=msg)


def evaluate_reply(msg: Message, context: Context) -> Message:
    """Held-out loss of the global adapter on this node's held-out split."""
    holder.STATS["calls"] += 1
    config = local_config(msg, context)
    cfg = TrainConfig.from_config(config)
    holder.configure_threads(cfg.client_threads)
    pid = partition_id(context)
    lm = holder.get_lora_model(holder.client_model_ref(config), cfg)
    holder.set_adapter(lm, record_arrays(msg, keys.REC_GLOBAL))
    heldout = device_data(config, context, cfg).heldout
    bos = model_bos_token_id(holder.resolve_model(holder.client_model_ref(config)))
    loss, scored = evaluate_tokens(lm.model, np.asarray(heldout), cfg, lm.device, bos)
    metrics = MetricRecord(
        {
            keys.MET_EVAL_LOSS: loss,
            keys.MET_NUM_EXAMPLES: scored,
            keys.MET_PARTITION: pid,
            **_cache_metrics(),
        }
    )
    return Message(RecordDict({keys.REC_METRICS: metrics}), reply_to=msg)
