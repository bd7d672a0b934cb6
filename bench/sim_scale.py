"""Simulation speed and memory at population scale: fedge's in-process engine vs a bare loop.

On a tiny per-client workload (the micro zoo, a few local steps on a few tokens) a
simulator's own machinery, not training, sets the pace. In one run, in one process,
on the same sampled clients and the same local compute:

* bare:      a plain loop: load the global adapter, a few optimizer steps, take the
             delta, sum; no messages, no server loop;
* inprocess: ``fedge simulate --engine inprocess``: the real ServerApp and ClientApp
             through :class:`fedge.simulations.inprocess.InProcessGrid` (its round also
             validates, checkpoints, evaluates on the server and writes metrics);
* ray:       Flower's Ray simulation of the same workload (reference, fewer rounds, a
             population of one round's clients, all sampled).

Figures are client updates per second over the steady rounds (round 1 warms up), and
the ratio to the bare loop (goal >= 0.7x). Then peak RSS of a child process that
runs the in-process engine with populations of 100, 1,000 and 10,000 devices, 100
sampled per round (goal: RSS at 10,000 <= 1.2x RSS at 100).

Prints one JSON object as the last line and writes it to bench/results/sim_scale.json.
Usage: python bench/sim_scale.py [--population 1000] [--per-round 100] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "sim_scale.json"
WORKLOAD = {
    "model": "zoo:micro",
    "max-chars-per-client": 20000,
    "local-steps": 2,
    "batch-size": 2,
    "seq-len": 16,
    "lora-r": 4,
    "lora-alpha": 8,
    "client-eval": False,
    "server-eval-batches": 1,
    "save-merged": False,
    "min-train-nodes": 1,
    "min-available-nodes": 1,
}


def _config(population: int, per_round: int, rounds: int, run_dir: Path) -> Any:
    from fedge.server.config import RunConfig

    return RunConfig.from_mapping(
        {
            **WORKLOAD,
            "num-server-rounds": rounds,
            "fraction-train": min(1.0, per_round / population),
            "run-dir": str(run_dir),
            "client-state-dir": str(run_dir / "client-state"),
        }
    )


def run_fedge(engine: str, population: int, per_round: int, rounds: int) -> dict[str, Any]:
    """Run the federation on ``engine``; updates/s over rounds >= 2 from the run's metrics."""
    from fedge.simulations.runner import Scenario, run_simulation

    with tempfile.TemporaryDirectory(prefix=f"sim-scale-{engine}-") as tmp:
        run_dir = Path(tmp) / "run"
        scenario = Scenario(
            name=f"sim-scale-{engine}",
            description="bench/sim_scale.py",
            num_supernodes=population,
            client_cpus=1,
            client_gpus=0.0,
            config=_config(population, per_round, rounds, run_dir),
            engine=engine,
        )
        t0 = time.perf_counter()
        outcome = run_simulation(scenario, run_dir)
        total = time.perf_counter() - t0
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if outcome is None or outcome.status != "completed":
        raise SystemExit(f"{engine} run did not complete: {outcome}")
    steady = [r for r in rows if r["round"] >= 2]
    seconds = sum(r["round_seconds"] for r in steady)
    updates = sum(r["clients_succeeded"] for r in steady)
    return {
        "updates": updates,
        "seconds": round(seconds, 3),
        "updates_per_s": round(updates / seconds, 2),
        "run_seconds_with_startup": round(total, 2),
    }


def run_bare(population: int, per_round: int, rounds: int) -> dict[str, Any]:
    """The same local work with no framework: same clients, steps, tokens; FedAvg in a plain loop."""
    import numpy as np

    from fedge.data.shards import device_tokens
    from fedge.lm import holder

    cfg = _config(population, per_round, rounds, Path(tempfile.gettempdir()))
    client_config = cfg.client_config()
    holder.configure_threads(0)
    lm = holder.get_lora_model(holder.resolve_model(cfg.model), cfg.train)
    corpus = holder.get_corpus(client_config)
    rng = np.random.default_rng(cfg.seed)
    adapter = {k: v.copy() for k, v in lm.initial.items()}
    seconds, updates = 0.0, 0
    for server_round in range(1, rounds + 1):
        t0 = time.perf_counter()
        sampled = sorted(rng.choice(population, size=min(per_round, population), replace=False))
        total = {k: np.zeros_like(v) for k, v in adapter.items()}
        weight = 0.0
        for pid in (int(p) for p in sampled):
            tokens = device_tokens(corpus, pid, population, cfg.train.seq_len + 1).train
            local = _bare_client(lm, adapter, tokens, cfg, server_round, pid)
            n = max(1, len(tokens) // cfg.train.seq_len)
            for k in total:
                total[k] += (local[k] - adapter[k]) * n
            weight += n
        adapter = {k: adapter[k] + total[k] / weight for k in adapter}
        if server_round >= 2:
            seconds += time.perf_counter() - t0
            updates += len(sampled)
    return {
        "updates": updates,
        "seconds": round(seconds, 3),
        "updates_per_s": round(updates / seconds, 2),
    }


def _bare_client(
    lm: Any, adapter: dict[str, Any], tokens: Any, cfg: Any, server_round: int, pid: int
) -> dict[str, Any]:
    """One client update as the ClientApp computes it: same seeds, batches, optimizer, steps."""
    import numpy as np
    import torch

    from fedge.clients.trainer import (
        build_optimizer,
        random_windows,
        resolve_optimizer,
        run_local_steps,
    )
    from fedge.lm import holder
    from fedge.lm.config import derive_seed
    from fedge.lm.evaluate import autocast_context, lm_batch_loss
    from fedge.strategies.base import ClientHook
    from fedge.strategies.registry import build_strategy

    train = cfg.train
    holder.set_adapter(lm, adapter)
    rng = np.random.default_rng(derive_seed(cfg.seed, "batches", server_round, pid))
    torch.manual_seed(derive_seed(cfg.seed, "torch", server_round, pid))
    batches = [
        random_windows(tokens, train.batch_size, train.seq_len, rng).to(lm.device)
        for _ in range(train.local_steps)
    ]
    fedavg = build_strategy({"strategy": "fedavg"})
    name = resolve_optimizer(train, fedavg.local_optimizer)
    model, optimizer = build_optimizer(lm.model, list(lm.params.values()), train, name)
    model.train()
    run_local_steps(
        lm.params,
        lambda step: lm_batch_loss(model, batches[step]),
        train.local_steps,
        optimizer,
        ClientHook(),  # FedAvg's client hook does nothing
        train.max_grad_norm,
        autocast_context(lm.device, train.precision),
    )
    return holder.adapter_arrays(lm)  # type: ignore[no-any-return]


def run_ray(population: int, rounds: int) -> dict[str, Any]:
    """Flower's Ray simulation of the same workload, or why it did not complete."""
    try:
        return {"population": population, **run_fedge("ray", population, population, rounds)}
    except (SystemExit, Exception) as exc:  # a loaded machine can time Ray's start-up out
        return {"population": population, "error": f"{type(exc).__name__}: {exc}"}


def _rss_child(population: int, per_round: int) -> None:
    """Child process: two in-process rounds with ``population`` devices; print peak RSS in MiB."""
    from fedge.zoo import ensure_zoo

    ensure_zoo("micro")
    result = run_fedge("inprocess", population, per_round, 2)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"population": population, "peak_rss_mib": round(peak, 1), **result}))


def _rss(population: int, per_round: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(population), "--per-round", str(per_round)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if out.returncode != 0:
        raise SystemExit(f"RSS child for {population} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ray-rounds", type=int, default=2, help="0 skips the Ray reference")
    parser.add_argument("--rss", default="100,1000,10000", help="populations for the RSS figures")
    parser.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        _rss_child(args.rss_child, args.per_round)
        return

    from fedge.zoo import ensure_zoo

    ensure_zoo("micro")
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    # bare, in-process, bare again: the machine's drift shows as a gap between the two bare runs
    bare_a = run_bare(args.population, args.per_round, args.rounds)
    inproc = run_fedge("inprocess", args.population, args.per_round, args.rounds)
    bare_b = run_bare(args.population, args.per_round, args.rounds)
    bare_rate = (bare_a["updates_per_s"] + bare_b["updates_per_s"]) / 2
    # Ray: a population of per-round nodes, all sampled (its per-update cost does not depend on
    # the population, while querying 1,000 nodes through it takes minutes on a loaded machine)
    ray = run_ray(args.per_round, args.ray_rounds) if args.ray_rounds >= 2 else None
    rss = [_rss(int(p), args.per_round) for p in args.rss.split(",") if p]
    by_pop = {r["population"]: r["peak_rss_mib"] for r in rss}
    result: dict[str, Any] = {
        "workload": {**WORKLOAD, "population": args.population, "per_round": args.per_round},
        "bare": [bare_a, bare_b],
        "inprocess": inproc,
        "inprocess_vs_bare": round(inproc["updates_per_s"] / bare_rate, 3),
        "ray": ray,
        "ray_vs_bare": round(ray["updates_per_s"] / bare_rate, 3)
        if ray and "updates_per_s" in ray
        else None,
        "rss": rss,
        "rss_ratio_largest_vs_smallest": round(by_pop[max(by_pop)] / by_pop[min(by_pop)], 3)
        if by_pop
        else None,
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
