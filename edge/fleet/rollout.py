"""Canary rollout of a federated LoRA adapter: check it, serve it to a fraction, compare, decide.

1. `check_adapter` refuses an adapter that does not fit before any traffic.
2. The new adapter is deployed as its own application beside the stable one;
   the ingress sends `canary` of new sessions to it.
3. The canary serves a warm-up (`warmup_s`) first; then both arms' figures start from zero
   together, so they cover one window. Over it the ingress records acceptance, error rate
   and latency per application, and at its end each replica reports its own seconds per
   work token per kind of call (`fedge.edge.fleet.speed.ReplicaSpeed`: its time over the
   work it waited through, so a replica given more of the load is not judged slower for
   it); `decide` compares them (a pure function of the figures).
4. Promote: the canary application takes every new session and the old one is
   deleted (its sessions reopen on the new replicas, NOT_FOUND -> reopen). Roll
   back: the canary is deleted. The decision and figures go to `rollout.json`.

Every step is recorded in the fleet's shared state before it is taken (`progress`),
and the routing changes there in one step, so an ingress that dies mid-rollout is
rebuilt with the canary, its split and its figures, and the controller carries on;
a controller that dies leaves a record that the next rollout resolves first
(`recover_rollout`): a promoted canary keeps the traffic and the old version is
deleted, an unpromoted one is rolled back. No step deletes an application that the
routing still names.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fedge.edge.fleet.adapters import check_adapter
from fedge.edge.fleet.speed import Speed

LOG = logging.getLogger("fedge.fleet")
DECISION_FILE = "rollout.json"
NOISE_Z = 2.0  # a drop within 2 standard errors (over sessions) of the tolerance is forgiven
LATENCY_FLOOR_MS = 5.0  # p99 differences below this are noise on a shared CPU
Speeds = dict[str, Speed]  # seconds per work token (and its noise) per kind of call


@dataclass(frozen=True)
class RolloutConfig:
    """The canary's share of traffic, the observation window and the promotion thresholds."""

    adapter_dir: Path
    run_dir: Path
    canary: float = 0.1  # fraction of new sessions served by the new adapter
    window_s: float = 60.0  # observe at least this long
    min_verifies: int = 50  # per application; the window extends up to max_window_s to get them
    min_sessions: int = 10  # per application, likewise: acceptance is compared over sessions
    max_window_s: float = 600.0
    max_acceptance_drop: float = (
        0.05  # canary acceptance may trail stable's by this much (absolute)
    )
    max_error_rate_rise: float = 0.01  # canary error rate may exceed stable's by this much
    max_latency_ratio: float = 1.5  # canary service time (or p50/p99) may be this many x stable's
    canary_replicas: int = 1
    poll_s: float = 0.5
    warmup_s: float = 5.0  # the canary serves this long before the window (and its figures) start

    def __post_init__(self) -> None:
        if not 0.0 < self.canary < 1.0:
            raise ValueError(f"RolloutConfig.canary must lie in (0, 1), got {self.canary}")
        if not 0 < self.window_s <= self.max_window_s:
            raise ValueError(
                f"RolloutConfig needs 0 < window_s <= max_window_s, got {self.window_s}, "
                f"{self.max_window_s}"
            )
        for name in (
            "min_verifies",
            "min_sessions",
            "canary_replicas",
            "max_latency_ratio",
            "poll_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"RolloutConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.warmup_s < 0:
            raise ValueError(f"RolloutConfig.warmup_s must be >= 0, got {self.warmup_s}")


def speed_ratio(stable: Speeds, canary: Speeds) -> tuple[float, float] | None:
    """The canary's service time over the stable's, and the standard error of its logarithm.

    The median, over the kinds of call both arms measured, of the canary's seconds per work
    token over the stable's (None: no kind in common). Per work token (the call and what it
    waited behind on its replica), so the arms are compared like for like whatever share of
    the load each replica got; the median over kinds and each speed's median over its last
    calls (`SpeedMeter`) absorb a stall. The noise is the two arms' (`Speed.log_se`) combined,
    for the kind (or the two kinds, averaged) the median falls on.
    """
    common = sorted(
        (canary[k].seconds / stable[k].seconds, math.hypot(stable[k].log_se, canary[k].log_se))
        for k in set(stable) & set(canary)
        if stable[k].seconds > 0
    )
    if not common:
        return None
    middle = len(common) // 2
    if len(common) % 2:
        return common[middle]
    (low, low_se), (high, high_se) = common[middle - 1], common[middle]
    return (low + high) / 2, (low_se + high_se) / 2


def decide(
    stable: dict[str, float],
    canary: dict[str, float],
    config: RolloutConfig,
    speeds: tuple[Speeds, Speeds] | None = None,
) -> tuple[str, list[str]]:
    """ "promote" or "rollback", with the reasons (every failed criterion, or why it passed).

    Latency: with the replicas' speeds (`speeds`: stable's, canary's) in common kinds, the
    canary's service time per work token (`speed_ratio`) may be `max_latency_ratio` times the
    stable's, widened by its noise as acceptance is (`NOISE_Z` standard errors of the ratio's
    logarithm: a good canary measured 1.60x on a few spread calls on a shared CPU); the
    ingress's p50/p99, which count queueing behind other calls on a replica
    that got more of the load (one canary replica beside N stable ones), do not decide alone:
    a canary is rolled back on latency only when it is also slower at the p50 the devices see
    (a fresh replica's few calls on a shared CPU measured a good adapter 2.63x slower per work
    token while its p50 was lower, 162.9 vs 179.2 ms). Without speeds in common, p50 and p99
    decide (`max_latency_ratio` + a floor).

    Acceptance is compared per session (`ArmStats`: each session's accepted / drafted is
    one observation, its noise the standard error over sessions), not per drafted token:
    tokens of one session share its prompt and luck, and a few long lucky sessions would
    otherwise carry a canary's pooled acceptance and pass it off as precise.
    """
    reasons = []
    for key, need in (("verifies", config.min_verifies), ("sessions", config.min_sessions)):
        if canary[key] < need or stable[key] < need:
            reasons.append(
                f"too little traffic: {canary[key]:.0f} canary and {stable[key]:.0f} "
                f"stable {key}, need {need} each"
            )
    ours, theirs = canary["session_acceptance"], stable["session_acceptance"]
    drop = theirs - ours
    noise = NOISE_Z * math.hypot(stable["session_acceptance_se"], canary["session_acceptance_se"])
    if drop > config.max_acceptance_drop + noise:
        reasons.append(
            f"acceptance {ours:.3f} vs stable {theirs:.3f} per session "
            f"(drop {drop:.3f} > {config.max_acceptance_drop} + noise {noise:.3f})"
        )
    rise = canary["error_rate"] - stable["error_rate"]
    if rise > config.max_error_rate_rise:
        reasons.append(
            f"error rate {canary['error_rate']:.3f} vs stable {stable['error_rate']:.3f} "
            f"(rise {rise:.3f} > {config.max_error_rate_rise})"
        )
    measured = None if speeds is None else speed_ratio(*speeds)
    if measured is not None:
        ratio, log_se = measured
        slower_end_to_end = canary["latency_p50_ms"] > stable["latency_p50_ms"]
        allowed = config.max_latency_ratio * math.exp(NOISE_Z * log_se)
        if ratio > allowed and slower_end_to_end:
            reasons.append(
                f"service time {ratio:.2f}x the stable's per work token > "
                f"{config.max_latency_ratio} x noise {allowed / config.max_latency_ratio:.2f} "
                f"(p50 {canary['latency_p50_ms']:.1f} vs {stable['latency_p50_ms']:.1f} ms)"
            )
    else:
        for key in ("latency_p50_ms", "latency_p99_ms"):
            limit = stable[key] * config.max_latency_ratio + LATENCY_FLOOR_MS
            if canary[key] > limit:
                reasons.append(f"{key} {canary[key]:.1f} > {limit:.1f} (stable {stable[key]:.1f})")
    if reasons:
        return "rollback", reasons
    service = "" if measured is None else f", service time {measured[0]:.2f}x"
    return "promote", [
        f"acceptance {ours:.3f} vs {theirs:.3f} per session, error rate "
        f"{canary['error_rate']:.3f} vs {stable['error_rate']:.3f}, p99 "
        f"{canary['latency_p99_ms']:.1f} vs {stable['latency_p99_ms']:.1f} ms{service}"
    ]


def _next_version(stable: str) -> str:
    """Application name of the version after `stable` (fedge-v3 after fedge-v2)."""
    from fedge.edge.fleet.app import VERSION_PREFIX, version_app

    return version_app(int(stable.removeprefix(VERSION_PREFIX)) + 1)


def app_speeds(app: str) -> Speeds:
    """Seconds per work token per kind of call of `app`: per kind, the median over its live
    replicas of each one's own report (`VerifierReplica.speed_report`; a replica gone
    meanwhile is left out)."""
    from ray import serve

    from fedge.edge.fleet.app import replica_actors
    from fedge.edge.fleet.ingress import REPLICA_DEPLOYMENT
    from fedge.edge.fleet.wire import ROUTE_PIN

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=app)
    by_kind: dict[str, list[Speed]] = {}
    for replica in replica_actors(app):
        try:
            report = handle.speed_report.remote(**{ROUTE_PIN: replica}).result(timeout_s=30)
        except Exception as err:  # stopped meanwhile, or too busy to answer: not counted
            LOG.warning("speed of replica %s of %s: %r", replica, app, err)
            continue
        for kind, (seconds, log_se) in dict(report).items():
            by_kind.setdefault(kind, []).append(Speed(float(seconds), float(log_se)))
    return {kind: sorted(v)[len(v) // 2] for kind, v in by_kind.items()}


def _observe(ingress: Any, stable: str, canary: str, config: RolloutConfig) -> dict[str, Any]:
    """Let the canary warm up, start both arms' figures together, then wait out the window
    (longer, up to max_window_s, until both arms have enough traffic)."""
    if config.warmup_s > 0:
        time.sleep(config.warmup_s)
        ingress.reset_arm_stats.remote().result()
    started = time.monotonic()
    while True:
        time.sleep(config.poll_s)
        figures = ingress.arm_stats.remote().result()
        elapsed = time.monotonic() - started
        enough = all(
            figures[a]["verifies"] >= config.min_verifies
            and figures[a]["sessions"] >= config.min_sessions
            for a in (stable, canary)
        )
        if (elapsed >= config.window_s and enough) or elapsed >= config.max_window_s:
            return {"window_s": elapsed, **figures}


def recovery(progress: dict[str, Any] | None, routing: dict[str, Any]) -> tuple[str, str | None]:
    """What an interrupted rollout (`progress`) needs, given the routing in force now:
    ("none", None), ("finish", the old version to delete) when its canary was promoted,
    else ("rollback", the canary to delete)."""
    if progress is None:
        return "none", None
    canary, old = progress["canary"], progress["stable"]
    if routing["stable"] == canary:
        return "finish", old if old != canary else None
    return "rollback", canary if canary != routing["stable"] else None


def recover_rollout(ingress: Any) -> str:
    """Resolve a rollout a dead controller left (`recovery`); returns what was done."""
    from ray import serve

    progress = ingress.rollout.remote().result()
    action, doomed = recovery(progress, ingress.describe.remote().result())
    if action == "rollback" and ingress.describe.remote().result()["canary"] == doomed:
        ingress.set_canary.remote(None).result()  # off the routing before it is deleted
    if doomed is not None and doomed in serve.status().applications:
        serve.delete(doomed)
    ingress.set_rollout.remote(None).result()
    if action != "none":
        LOG.warning("interrupted rollout %s: %s (deleted %s)", progress, action, doomed)
    return action


def run_rollout(ingress: Any, key: bytes, config: RolloutConfig) -> dict[str, Any]:
    """Run one canary rollout against a live fleet's ingress handle (`key`: the fleet key,
    which unseals the stable config and seals the promoted one); returns the decision."""
    from ray import serve

    from fedge.edge.fleet.app import replica_actors, replica_application, stored_config

    recover_rollout(ingress)
    fleet = stored_config(ingress, key)
    stable = ingress.describe.remote().result()["stable"]
    config.run_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "adapter": str(config.adapter_dir),
        "current_adapter": str(fleet.adapter_dir) if fleet.adapter_dir else None,
        "stable_app": stable,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }
    try:
        check_adapter(fleet.model_dir, config.adapter_dir)
    except Exception as err:
        record.update(decision="refused", reasons=[str(err)])
        return _write(config.run_dir, record)
    canary = _next_version(stable)
    record["canary_app"] = canary
    progress = {"stable": stable, "canary": canary, "adapter": str(config.adapter_dir)}
    ingress.set_rollout.remote({**progress, "phase": "deploying"}).result()
    canary_fleet = replace(fleet, replicas=config.canary_replicas, max_replicas=None)
    try:
        serve.run(
            replica_application(canary_fleet, config.adapter_dir), name=canary, route_prefix=None
        )
    except Exception as err:  # the replicas could not load it: no traffic was sent
        serve.delete(canary)
        ingress.set_rollout.remote(None).result()
        record.update(decision="refused", reasons=[f"canary failed to start: {err}"])
        return _write(config.run_dir, record)
    record["canary_replica_ids"] = sorted(replica_actors(canary))
    ingress.set_rollout.remote({**progress, "phase": "observing"}).result()
    ingress.set_canary.remote(canary, config.canary).result()
    figures = _observe(ingress, stable, canary, config)
    speeds = (app_speeds(stable), app_speeds(canary))
    decision, reasons = decide(figures[stable], figures[canary], config, speeds)
    record.update(
        decision=decision,
        reasons=reasons,
        figures=figures,
        speeds={stable: speeds[0], canary: speeds[1]},
    )
    if decision == "promote":
        serve.run(  # the canary grows to the fleet's size around its replicas (same version)
            replica_application(fleet, config.adapter_dir), name=canary, route_prefix=None
        )
        promoted = replace(fleet, adapter_dir=config.adapter_dir)
        ingress.promote.remote(canary, promoted.seal(key)).result()
        ingress.set_rollout.remote({**progress, "phase": "promoted"}).result()
        serve.delete(stable)
    else:
        ingress.set_canary.remote(None).result()
        serve.delete(canary)
    ingress.set_rollout.remote(None).result()
    LOG.info("rollout of %s: %s (%s)", config.adapter_dir, decision, "; ".join(reasons))
    return _write(config.run_dir, record)


def _write(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Record the decision and figures as JSON in the run directory; return the record."""
    record["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (run_dir / DECISION_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    return record
