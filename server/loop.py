"""The federated round loop, written once, as named steps that can each be tested alone.

A run: :func:`connect` (wait for nodes, learn their partitions), :func:`open_run` (start
fresh or resume from the newest checkpoint), then per round:

  1. :func:`budget_allows`: ask the privacy budget whether this round may be released
     (else stop cleanly);
  2. :func:`sample_cohort`: sample, with the checkpointed RNG, from the nodes connected
     now, in partition order (:mod:`fedge.server.membership`: nodes join and leave);
  3. :func:`train_exchange`: hand the train message to the aggregator, which returns the
     SUM of valid contributions (malformed replies are rejected and logged by node id);
  4. :func:`aggregate_and_account`: ``strategy.finalize`` turns the sum into the next
     global adapter and state (only when at least ``min-train-nodes`` updates are in it:
     dropped work counts toward no minimum); the budget records the release;
  5. :func:`evaluate_round`: server-side perplexity on the union of held-out splits and on
     the participants' own, and the sampled clients' held-out loss;
  6. :func:`checkpoint_and_report`: write the metrics row and the checkpoint;
  7. :func:`rejected_rounds_reached`: under SecAgg+, stop once ``max-rejected-rounds`` sums
     broke the per-client bounds (each rejected round logs which bound);
  8. :func:`plateau_reached`: with ``plateau-patience``, stop once the participants'
     held-out perplexity stops improving (:mod:`fedge.server.plateau`).

A round with fewer valid replies than ``min-train-nodes`` fails (:func:`shortfall`): the
run stops with ``status.json`` saying why, its last checkpoint intact, resumable with
``--resume``.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from flwr.serverapp import Grid

from fedge import keys
from fedge.data.shards import device_pools
from fedge.lm import holder
from fedge.plugins import load_dotted
from fedge.privacy.wire import KEY_DPSGD_NOISE, REFUSAL_BUDGET
from fedge.server.aggregation import (
    AggregateResult,
    Aggregator,
    PlainAggregator,
    build_aggregator,
    rejected_rounds_message,
)
from fedge.server.budget import PrivacyBudget
from fedge.server.checkpoint import (
    Checkpoint,
    archive_previous_run,
    check_resumable,
    latest_round,
    load_checkpoint,
    save_checkpoint,
)
from fedge.server.config import RunConfig
from fedge.server.membership import Roster, federation_size, resolve_partition_count, sample_nodes
from fedge.server.messages import (
    NODE_WAIT_SECONDS,
    client_evaluate,
    query_partitions,
    server_config,
    train_content,
)
from fedge.server.model import ServerModel
from fedge.server.plateau import plateaued
from fedge.server.privacy.config import DPConfig
from fedge.server.privacy.factories import default_budget
from fedge.server.privacy.plots import plot_privacy
from fedge.server.rows import round_row, write_status
from fedge.server.rundir import MetricsLog, plot_perplexity, write_config
from fedge.server.sampling import Draw, budget_for, draw_cohort, sampling_scheme
from fedge.strategies.base import Arrays, GlobalState, Strategy, replace_state
from fedge.strategies.registry import build_strategy

log = logging.getLogger(__name__)

RowCallback = Callable[[Mapping[str, Any]], None]
__all__ = [
    "LoopOutcome",
    "RowCallback",
    "ServerModel",
    "query_partitions",
    "resolve_partition_count",
    "run_federation",
    "train_content",
]


@dataclass(frozen=True)
class LoopOutcome:
    """How a run ended: ``completed``, ``budget`` (privacy budget spent) or ``failed``."""

    status: str
    message: str
    run_dir: Path
    state: GlobalState | None
    adapter_dir: Path | None


@dataclass(frozen=True)
class Parts:
    """What a run is made of: the strategy, the aggregator and the privacy budget."""

    strategy: Strategy
    aggregator: Aggregator
    budget: PrivacyBudget


@dataclass
class Federation:
    """One run: its parts (fixed for the run) and its progress (``state``, ``rng``, ``committed``)."""

    grid: Grid
    cfg: RunConfig
    run_dir: Path
    strategy: Strategy
    aggregator: Aggregator
    budget: PrivacyBudget
    roster: Roster
    server_model: ServerModel
    metrics: MetricsLog
    participants: list[int]  # partitions whose held-out text scores the participants
    state: GlobalState
    rng: np.random.Generator
    committed: dict[int, int]  # partition -> last round whose aggregate holds its update
    on_row: RowCallback


@dataclass(frozen=True)
class Cohort:
    """Who one round asks: the connected candidates, the N they stand for, K wanted, the sample."""

    candidates: list[int]
    population: int
    target: int
    sampled: list[int]
    draw: Draw | None = None  # how it was drawn, under privacy-sampling


@dataclass(frozen=True)
class Losses:
    """One round's held-out losses: whole corpus, participants' own, and the clients' reports."""

    loss: float
    part_loss: float
    client_loss: float = math.nan


def default_run_dir() -> Path:
    """``runs/flwr-<UTC time>`` under the working directory (used when ``run-dir`` is empty)."""
    return Path("runs") / datetime.now(UTC).strftime("flwr-%Y%m%d-%H%M%S")


def build_budget(cfg: RunConfig, aggregator: Aggregator) -> PrivacyBudget:
    """The accountant named by ``privacy-budget`` (a dotted factory), else the aggregator's own,
    amplified by the cohort's sampling when ``privacy-sampling`` draws it as an accountant
    assumes (:mod:`fedge.server.sampling`)."""
    scheme = sampling_scheme(cfg.extra, cfg.over_selection)
    dp = getattr(aggregator, "cfg", None)
    if not cfg.privacy_budget and scheme and isinstance(dp, DPConfig):
        return budget_for(dp, scheme)
    if not cfg.privacy_budget:
        return default_budget(cfg, aggregator)
    return load_dotted(cfg.privacy_budget, what="config key 'privacy-budget'")(cfg)  # type: ignore[return-value]


# ---------------------------------------------------------------- the run
def run_federation(
    grid: Grid, cfg: RunConfig, resume: bool = False, on_row: RowCallback | None = None
) -> LoopOutcome:
    """Run (or resume) the configured federation on ``grid``; always leaves status.json behind."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir()
    try:
        return _run(grid, cfg, run_dir, resume, on_row or (lambda _row: None))
    except Exception as exc:
        write_status(run_dir, "failed", f"{type(exc).__name__}: {exc}")
        raise


def _run(
    grid: Grid, cfg: RunConfig, run_dir: Path, resume: bool, on_row: RowCallback
) -> LoopOutcome:
    parts = build_parts(cfg)
    roster, cfg = connect(grid, cfg)
    fed = open_run(grid, cfg, run_dir, resume, roster, parts, on_row)
    status, message = "completed", f"{fed.cfg.num_server_rounds} rounds done"
    for server_round in range(fed.state.server_round + 1, fed.cfg.num_server_rounds + 1):
        if not budget_allows(fed, server_round):
            status = "budget"
            message = (
                f"stopped before round {server_round}: it would exceed "
                f"max-epsilon={fed.cfg.max_epsilon} (spent {fed.budget.epsilon():.3f})"
            )
            break
        t0 = time.perf_counter()
        cohort = sample_cohort(fed)
        if not draw_allowed(fed, cohort):
            status = "budget"
            message = (
                f"stopped before round {server_round}: its cohort, drawn at rate "
                f"{cohort.draw.rate if cohort.draw else 1.0:.4f}, would exceed "
                f"max-epsilon={fed.cfg.max_epsilon} (spent {fed.budget.epsilon():.3f})"
            )
            break
        if cohort.draw is not None and len(cohort.sampled) < fed.cfg.min_train_nodes:
            checkpoint_and_report(fed, empty_draw(fed, cohort, server_round, t0))
            continue
        result, train_phase = train_exchange(fed, cohort, server_round)
        problem = shortfall(fed, cohort, result, server_round)
        if problem is not None and _budget_spent(result.rejected):
            status = "budget"
            message = (
                f"stopped at round {server_round}: the sampled clients refused to train, their "
                f"own privacy budgets spent ({_describe(result.rejected)})"
            )
            break
        if problem is not None:
            return fail_round(fed, cohort, result, server_round, problem, time.perf_counter() - t0)
        row_status = aggregate_and_account(fed, cohort, result, server_round)
        losses = evaluate_round(fed, cohort, server_round)
        row = round_row(
            server_round,
            row_status,
            fed.strategy,
            loss=losses.loss,
            part_loss=losses.part_loss,
            client_loss=losses.client_loss,
            sampled=len(cohort.sampled),
            result=result,
            seconds=time.perf_counter() - t0,
            epsilon=fed.budget.epsilon(),
            budget=fed.budget,
            train_phase=train_phase,
            connected=len(cohort.candidates),
        )
        checkpoint_and_report(fed, row)
        if (stop := rejected_rounds_reached(fed, result)) is not None:
            status, message = "failed", stop
            break
        if plateau_reached(fed):
            message = (
                f"stopped after round {server_round}: the participants' held-out perplexity "
                f"improved by less than {fed.cfg.plateau_min_improvement:.2%} on its best in "
                f"{fed.cfg.plateau_patience} rounds (plateau-patience)"
            )
            break
    return finish(fed, status, message)


# ---------------------------------------------------------------- steps
def build_parts(cfg: RunConfig) -> Parts:
    """The strategy, the aggregator and the privacy budget the config names (bad names fail here)."""
    strategy = build_strategy(cfg.to_mapping())
    aggregator = build_aggregator(cfg.aggregator, cfg)
    if isinstance(aggregator, PlainAggregator) and aggregator.robust == strategy.robust:
        aggregator.combine = strategy.combine  # the strategy's rule: SCAFFOLD + Krum commits
        # only the selected client's c_i
    return Parts(strategy, aggregator, build_budget(cfg, aggregator))


def connect(grid: Grid, cfg: RunConfig) -> tuple[Roster, RunConfig]:
    """Wait for ``min-available-nodes`` and learn their partitions; resolve ``num-partitions``.

    Node ids change across restarts; partitions key the restart-proof sampling order and
    the clients' committed state.
    """
    roster = Roster(lambda g, nodes: query_partitions(g, nodes, cfg))
    roster.refresh(grid, cfg.min_available_nodes, NODE_WAIT_SECONDS)
    return roster, resolve_partition_count(cfg, roster.partitions_seen)


def open_run(
    grid: Grid,
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    roster: Roster,
    parts: Parts,
    on_row: RowCallback,
) -> Federation:
    """Start fresh (round 0 evaluated and checkpointed) or resume from the newest checkpoint.

    A resume is refused when the config changed; a fresh run moves an earlier run's outputs
    aside instead of mixing with them.
    """
    strategy, aggregator, budget = parts.strategy, parts.aggregator, parts.budget
    last = latest_round(run_dir) if resume else None
    ckpt = load_checkpoint(run_dir, last) if last is not None else None
    if ckpt is not None:
        check_resumable(ckpt, cfg, strategy, run_dir)
        roster.restore(ckpt.seen)  # N as it was, whoever is connected at the restart
    elif (archived := archive_previous_run(run_dir)) is not None:
        log.info("a fresh run in %s: the earlier run's outputs moved to %s", run_dir, archived)
    # held-out data of the nodes at the start (devices beyond the partitions: their pools);
    # a resume keeps the first start's, whoever is connected now
    participants = (
        ckpt.participants
        if ckpt is not None and ckpt.participants
        else device_pools(holder.get_corpus(server_config(cfg)), roster.partitions.values())
    )
    run_id = ckpt.run_id if ckpt is not None and ckpt.run_id else cfg.run_id or secrets.token_hex(8)
    cfg = cfg.with_overrides({keys.CFG_RUN_ID: run_id})
    server_model = ServerModel(cfg)
    write_config(run_dir, cfg.to_mapping())
    metrics = MetricsLog(run_dir)
    write_status(run_dir, "running", "")
    rng = np.random.default_rng(cfg.seed)
    resuming = ckpt is not None and last is not None
    if ckpt is not None and last is not None:
        rng.bit_generator.state = ckpt.rng_state
        budget.load_state(ckpt.budget_state)
        metrics.truncate_after(last)
        log.info("resuming %s from round %d", run_dir, last)
        state, committed = ckpt.state, dict(ckpt.committed)
    else:
        adapter = server_model.initial_adapter()
        state, committed = GlobalState(adapter, strategy.init_extras(adapter), 0), {}
    fed = Federation(
        grid,
        cfg,
        run_dir,
        strategy,
        aggregator,
        budget,
        roster,
        server_model,
        metrics,
        list(participants),
        state,
        rng,
        committed,
        on_row,
    )
    if resuming:
        return fed
    metrics.truncate_after(-1)
    row = round_row(
        0,
        "ok",
        strategy,
        loss=server_model.evaluate(state.adapter),
        part_loss=server_model.evaluate(state.adapter, fed.participants),
        sampled=0,
        epsilon=budget.epsilon(),
        budget=budget,
    )
    metrics.append(row)
    on_row(row)
    _checkpoint(fed)
    return fed


def rejected_rounds_reached(fed: Federation, result: AggregateResult) -> str | None:
    """Why the run stops after this round: ``max-rejected-rounds`` SecAgg+ sums (counted over
    the run's metrics, so a resume keeps the count) broke the per-client bounds; else None.

    A poisoned client under SecAgg+ gets every round's sum rejected (the server cannot tell
    which client broke the bound): without this the run would end at its initial model.
    """
    limit = fed.cfg.max_rejected_rounds
    if result.out_of_bounds is None or limit <= 0:
        return None
    rejected = sum(1 for row in fed.metrics.rows() if row.get("status") == "out-of-bounds")
    if rejected < limit:
        return None
    return rejected_rounds_message(rejected, limit, result.out_of_bounds)


def plateau_reached(fed: Federation) -> bool:
    """Whether the participants' held-out perplexity has plateaued (:mod:`fedge.server.plateau`);
    with the rule off, the metrics file is not read."""
    if fed.cfg.plateau_patience <= 0:
        return False
    curve = [row.get("participants_perplexity") for row in fed.metrics.rows()]
    return plateaued(curve, fed.cfg.plateau_patience, fed.cfg.plateau_min_improvement)


def budget_allows(fed: Federation, server_round: int) -> bool:
    """Whether the privacy budget lets this round be released (always, without ``max-epsilon``)."""
    return not (fed.cfg.max_epsilon > 0 and not fed.budget.allows(server_round))


def draw_allowed(fed: Federation, cohort: Cohort) -> bool:
    """Whether a budget that prices each draw (:mod:`fedge.server.sampling`) lets this cohort train."""
    allows_draw = getattr(fed.budget, "allows_draw", None)
    return cohort.draw is None or allows_draw is None or bool(allows_draw(cohort.draw))


def sample_cohort(fed: Federation) -> Cohort:
    """Sample K (1 + over-selection) of the nodes connected now (nodes join and leave)."""
    candidates = fed.roster.refresh(fed.grid, 0, fed.cfg.round_timeout)
    population = federation_size(fed.grid, fed.roster)
    target, sampled = sample_nodes(fed.rng, candidates, population, fed.cfg)
    scheme = sampling_scheme(fed.cfg.extra, fed.cfg.over_selection)
    if not scheme:
        return Cohort(candidates, population, target, sampled)
    # as the accountant assumes: K of the nodes eligible now, by a secret coin (fedge.server.sampling)
    draw = draw_cohort(scheme, candidates, target)
    return Cohort(candidates, population, len(draw.sampled), list(draw.sampled), draw)


def empty_draw(fed: Federation, cohort: Cohort, server_round: int, t0: float) -> dict[str, Any]:
    """A Poisson draw of fewer than ``min-train-nodes`` clients (nobody: chance (1 - q)^n each
    round) is a round without an update, not a failure: the model is kept, as in any round with
    fewer than ``min-train-nodes`` updates, and the round is accounted as drawn."""
    assert cohort.draw is not None
    fed.state = replace_state(fed.state, server_round=server_round)
    account_release(fed, cohort, server_round)
    log.info(
        "round %d: the %s draw sampled %d clients, fewer than min-train-nodes=%d; model kept",
        server_round,
        cohort.draw.scheme,
        len(cohort.sampled),
        fed.cfg.min_train_nodes,
    )
    losses = evaluate_round(fed, cohort, server_round)
    return round_row(
        server_round,
        "empty",
        fed.strategy,
        sampled=len(cohort.sampled),
        loss=losses.loss,
        part_loss=losses.part_loss,
        client_loss=losses.client_loss,
        seconds=time.perf_counter() - t0,
        epsilon=fed.budget.epsilon(),
        budget=fed.budget,
        connected=len(cohort.candidates),
    )


def train_exchange(
    fed: Federation, cohort: Cohort, server_round: int
) -> tuple[AggregateResult, float]:
    """Send the round's train message to the cohort; return the aggregate and its seconds."""
    partitions = fed.roster.partitions
    content = train_content(
        fed.state,
        fed.strategy,
        fed.cfg,
        server_round,
        cohort.target,
        {partitions[n]: fed.committed.get(partitions[n], 0) for n in cohort.sampled},
    )
    t_train = time.perf_counter()
    result = fed.aggregator.aggregate(
        fed.grid,
        server_round,
        cohort.sampled,
        content,
        fed.strategy.contribution_spec(fed.state),
        fed.cfg.round_timeout,
    )
    return result, time.perf_counter() - t_train


def shortfall(
    fed: Federation, cohort: Cohort, result: AggregateResult, server_round: int
) -> str | None:
    """Why the round cannot be aggregated (fewer valid replies than ``min-train-nodes``), or None."""
    if result.summed is not None and len(result.accepted) >= fed.cfg.min_train_nodes:
        return None
    return (
        f"round {server_round} failed: {len(result.accepted)} of {len(cohort.sampled)} sampled "
        f"clients returned valid updates, min-train-nodes is {fed.cfg.min_train_nodes}; rejected: "
        f"{_describe(result.rejected)}. The run is checkpointed at round {fed.state.server_round}: "
        f"fix the cause and continue with `fedge simulate --resume {fed.run_dir}`"
    )


def fail_round(
    fed: Federation,
    cohort: Cohort,
    result: AggregateResult,
    server_round: int,
    message: str,
    seconds: float,
) -> LoopOutcome:
    """Record the failed round's row and status; the last checkpoint stays the resume point."""
    row = round_row(
        server_round,
        "failed",
        fed.strategy,
        sampled=len(cohort.sampled),
        result=result,
        seconds=seconds,
        connected=len(cohort.candidates),
    )
    fed.metrics.append(row)
    fed.on_row(row)
    write_status(fed.run_dir, "failed", message)
    return LoopOutcome("failed", message, fed.run_dir, fed.state, None)


def aggregate_and_account(
    fed: Federation, cohort: Cohort, result: AggregateResult, server_round: int
) -> str:
    """Finalize the sum into the next state, record the release, mark the clients' committed
    round; return the row status (``empty``: too few updates; ``out-of-bounds``: the SecAgg+
    sum breaks the per-client bounds; either way the adapter is kept)."""
    assert result.summed is not None  # shortfall() refused the round otherwise
    if result.out_of_bounds is not None:  # SecAgg+: the sum breaks the clients' bounds
        log.warning("round %d rejected, global model kept: %s", server_round, result.out_of_bounds)
        fed.state, row_status = fed.state, "out-of-bounds"
    else:
        fed.state, row_status = next_state(
            fed.strategy, fed.state, result.summed, cohort.population, fed.cfg.min_train_nodes
        )
    if row_status != "ok":
        fed.state = replace_state(fed.state, server_round=server_round)
    account_release(fed, cohort, server_round)
    if row_status == "out-of-bounds":  # no client's work is in the global model
        return row_status
    partitions = fed.roster.partitions
    kept = result.accepted if result.committed is None else result.committed
    fed.committed.update({partitions[n]: server_round for n in kept if n in partitions})
    return row_status


def account_release(fed: Federation, cohort: Cohort, server_round: int) -> None:
    """Record the round in the privacy budget: at the rate its cohort was drawn with, when the
    budget prices draws, else by the cohort's size."""
    record_draw = getattr(fed.budget, "record_draw", None)
    if cohort.draw is not None and record_draw is not None:
        record_draw(server_round, cohort.draw)
    else:
        fed.budget.record(server_round, len(cohort.sampled), cohort.population)


def next_state(
    strategy: Strategy, state: GlobalState, summed: Arrays, population: int, min_updates: int
) -> tuple[GlobalState, str]:
    """The strategy's next state and ``ok``; or the state unchanged and ``empty`` when fewer
    than ``min_updates`` clients' work is in the sum: a dropped straggler's reply (zeros with
    ``meta/count`` 0) is a valid reply but no update, and counts toward no minimum."""
    if updates_in(summed) < min_updates or float(summed[keys.KEY_WEIGHT][0]) <= 0:
        return state, "empty"
    return strategy.finalize(state, summed, population), "ok"


def updates_in(summed: Arrays) -> int:
    """How many clients' work a sum holds (``meta/count``: 1 per kept update, 0 per dropped)."""
    return round(float(summed[keys.KEY_COUNT][0]))


def evaluate_round(fed: Federation, cohort: Cohort, server_round: int) -> Losses:
    """The whole corpus's and the participants' held-out loss, and the clients' own reports."""
    loss = fed.server_model.evaluate(fed.state.adapter)
    part_loss = fed.server_model.evaluate(fed.state.adapter, fed.participants)
    client_loss = (
        client_evaluate(fed.grid, cohort.sampled, fed.state, fed.cfg, server_round)
        if fed.cfg.client_eval and not _client_eval_withheld(fed)
        else math.nan
    )
    return Losses(loss, part_loss, client_loss)


_WITHHELD_SAID: set[str] = set()  # runs (by run dir) told that client-eval is withheld


def _client_eval_withheld(fed: Federation) -> bool:
    """Under DP-SGD or distributed DP clients keep their held-out loss (no mechanism accounts
    it, ``fedge.clients.privacy.replies``): the round asks them nothing and says so once."""
    cfg = fed.cfg
    try:
        dpsgd = float(str(cfg.client_config().get(KEY_DPSGD_NOISE, 0.0))) > 0
    except ValueError:
        dpsgd = False
    dp = getattr(fed.aggregator, "cfg", None)
    distributed = isinstance(dp, DPConfig) and dp.mode == "distributed"
    withheld = dpsgd or distributed
    if withheld and cfg.run_dir not in _WITHHELD_SAID:
        _WITHHELD_SAID.add(cfg.run_dir)
        log.warning(
            "client-eval under %s: the clients keep their held-out loss (outside the DP "
            "accounting), so none is asked and client_eval_loss stays empty; the server's own "
            "evaluation is unchanged (set client-eval = false to silence this)",
            "DP-SGD" if dpsgd else "distributed DP",
        )
    return withheld


def checkpoint_and_report(fed: Federation, row: Mapping[str, Any]) -> None:
    """Append the round's metrics row, hand it on, then write the round's checkpoint.

    ``on_row`` runs first so that state kept beside the run (the device clock) is saved
    before the checkpoint that names it: a crash between the two resumes from the previous
    checkpoint, whose outside state is still there.
    """
    fed.metrics.append(dict(row))
    fed.on_row(row)
    _checkpoint(fed)


def finish(fed: Federation, status: str, message: str) -> LoopOutcome:
    """Plot the run (unless ``plots`` is off), export the final adapter, write the final status."""
    if fed.cfg.plots:
        plot_perplexity({fed.strategy.name: fed.metrics.rows()}, fed.run_dir / "perplexity.png")
        plot_privacy(fed.metrics.rows(), fed.run_dir / "privacy.png")
    adapter_dir = fed.server_model.export(fed.state.adapter, fed.run_dir / "final")
    write_status(fed.run_dir, status, message)
    return LoopOutcome(status, message, fed.run_dir, fed.state, adapter_dir)


# ---------------------------------------------------------------- helpers
def _checkpoint(fed: Federation) -> None:
    save_checkpoint(
        fed.run_dir,
        Checkpoint(
            fed.state,
            dict(fed.rng.bit_generator.state),
            fed.budget.state(),
            fed.strategy.name,
            fed.cfg.run_id,
            dict(fed.cfg.to_mapping()),
            dict(fed.committed),
            fed.roster.seen(),
            list(fed.participants),
        ),
    )


def _budget_spent(rejected: Mapping[int, str]) -> bool:
    """Whether every refusal of a failed round is a client's exhausted privacy budget."""
    return bool(rejected) and all(REFUSAL_BUDGET in why for why in rejected.values())


def _describe(rejected: Mapping[int, str]) -> str:
    if not rejected:
        return "none"
    return "; ".join(f"node {n}: {why}" for n, why in sorted(rejected.items()))
