"""Benchmark privacy costs: SecAgg+ round overhead, DP-SGD step overhead, a privacy-utility sweep.

1. SecAgg+ (ours, Message API) against plain aggregation, at 10 and 50 clients per round,
   and side by side Flower's legacy ``SecAggPlusWorkflow`` against legacy plain FedAvg, all
   on the same vector size, each on Flower's simulation engine (Ray), ratios per pair.
2. DP-SGD (Opacus) step time against the same non-private AdamW step on the zoo model's LoRA.
3. Privacy-utility: central-DP federations at several noise multipliers; epsilon spent vs
   final held-out perplexity.

Usage: ``python bench/privacy.py [--clients 10,50] [--size 100000] [--rounds 3]
[--sweep-model zoo:default] [--sweep-noise 0,0.3,1,3] [--skip secagg,dpsgd,sweep]``. The last line of
output is one JSON object, also written to ``bench/results/privacy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}.items():
    os.environ.setdefault(_k, _v)

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "privacy.json"
BACKEND = {"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": os.cpu_count() or 2}}


# ---------------------------------------------------------------- 1. SecAgg+ overhead
def _vector(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.01, size).astype(np.float32)


def ours_round_times(num_clients: int, size: int, rounds: int) -> dict[str, Any]:
    """Seconds per round of plain vs SecAgg+ (default graph, and n/2 shares) on the Message API."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from clients.mods import dispatch_mods
    from fedge import keys
    from fedge.secagg.config import SecAggConfig
    from server.aggregation import PlainAggregator
    from server.secagg.aggregator import SecAggPlusAggregator

    spec = {"delta/v": (size,), "meta/weight": (1,), "meta/count": (1,)}
    client_app = ClientApp(mods=[dispatch_mods])

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        arrays = {"delta/v": _vector(pid, size), "meta/weight": np.ones(1, np.float32)}
        arrays["meta/count"] = np.ones(1, np.float32)
        record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        return Message(RecordDict({keys.REC_CONTRIB: record}), reply_to=msg)

    out: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(list(grid.get_node_ids())) < num_clients:
            time.sleep(0.2)
        nodes = sorted(grid.get_node_ids())
        content = RecordDict({keys.REC_CONFIG: ConfigRecord({keys.CFG_CLIENT_MODS: ""})})
        variants = {
            "plain": PlainAggregator(),
            "secagg": SecAggPlusAggregator(SecAggConfig()),
            "secagg_half_shares": SecAggPlusAggregator(SecAggConfig(num_shares=0.5)),
        }
        for name, agg in variants.items():
            agg.aggregate(grid, 0, nodes, content, spec, 600)  # warm-up: imports, actor caches
            t0 = time.perf_counter()
            stages: dict[str, float] = {}
            for r in range(rounds):
                result = agg.aggregate(grid, r + 1, nodes, content, spec, 600)
                if result.summed is None:
                    raise RuntimeError(f"{name} round failed: {result.rejected}")
                for stage, sec in getattr(agg, "last_stage_seconds", {}).items():
                    stages[stage] = stages.get(stage, 0.0) + sec / rounds
            out[name] = (time.perf_counter() - t0) / rounds
            if stages:
                out[f"{name}_stages"] = {k: round(v, 3) for k, v in stages.items()}  # type: ignore[assignment]

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_clients,
        backend_config=BACKEND,
    )  # type: ignore[arg-type]
    return out


def legacy_round_time(num_clients: int, size: int, rounds: int, secure: bool) -> float:
    """Seconds per round of Flower's legacy FedAvg workflow, with or without SecAggPlusWorkflow."""
    from flwr.app import Context
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    class VectorClient(NumPyClient):  # type: ignore[misc]
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [_vector(self.pid, size)], 1, {}

    def client_fn(context: Context):  # type: ignore[no-untyped-def]
        return VectorClient(int(context.node_config["partition-id"])).to_client()

    client_app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod] if secure else [])
    timing: dict[str, float] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=num_clients,
            min_available_clients=num_clients,
            initial_parameters=ndarrays_to_parameters([np.zeros(size, np.float32)]),
        )
        legacy = LegacyContext(
            context=context, config=ServerConfig(num_rounds=rounds), strategy=strategy
        )
        fit = SecAggPlusWorkflow(num_shares=0.5, reconstruction_threshold=2 / 3) if secure else None
        t0 = time.perf_counter()
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)
        timing["seconds"] = (time.perf_counter() - t0) / rounds

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_clients,
        backend_config=BACKEND,
    )  # type: ignore[arg-type]
    return timing["seconds"]


def secagg_overhead(clients: list[int], size: int, rounds: int) -> dict[str, Any]:
    """Round-time ratios at each client count."""
    out: dict[str, Any] = {}
    for n in clients:
        ours = ours_round_times(n, size, rounds)
        legacy_plain = legacy_round_time(n, size, rounds, secure=False)
        legacy_secure = legacy_round_time(n, size, rounds, secure=True)
        out[str(n)] = {
            "ours_plain_s": round(ours["plain"], 3),
            "ours_secagg_s": round(ours["secagg"], 3),
            "ours_secagg_half_shares_s": round(ours["secagg_half_shares"], 3),
            "ours_ratio": round(ours["secagg"] / ours["plain"], 3),
            "ours_half_shares_ratio": round(ours["secagg_half_shares"] / ours["plain"], 3),
            "legacy_plain_s": round(legacy_plain, 3),
            "legacy_secaggplus_s": round(legacy_secure, 3),
            "legacy_ratio": round(legacy_secure / legacy_plain, 3),
            "ours_secagg_stage_s": ours.get("secagg_stages", {}),
        }
        print(f"secagg n={n}: {out[str(n)]}", flush=True)
    return out


# ---------------------------------------------------------------- 2. DP-SGD overhead
def dpsgd_overhead(model: str, steps: int, batch_size: int, seq_len: int) -> dict[str, Any]:
    """Median seconds per step: Opacus DP-SGD vs the same AdamW step without privacy.

    Both run on the same peft model (fp32, the same LoRA tensors trainable); the non-private
    step runs with Opacus' hooks disabled. Steps alternate between the two so that load
    from other processes hits both alike.
    """
    import warnings

    import torch
    from opacus import PrivacyEngine

    from clients.privacy.dpsgd import lm_loss, token_records
    from clients.privacy.local import apply_ffa
    from fedge.lm import holder
    from fedge.lm.config import TrainConfig

    cfg = TrainConfig(batch_size=batch_size, seq_len=seq_len, precision="fp32")
    lm = holder.get_lora_model(holder.resolve_model(model), cfg)
    tokens = np.random.default_rng(0).integers(0, 256, size=400 * (seq_len + 1))
    records = token_records(tokens, seq_len)
    out: dict[str, Any] = {"model": model, "batch_size": batch_size, "seq_len": seq_len}
    for label, ffa in (("", False), ("ffa_", True)):
        apply_ffa(lm.model, ffa)
        params = [p for p in lm.model.parameters() if p.requires_grad]
        plain_opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        dp_opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(records), batch_size=batch_size
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private, dp_optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
                module=lm.model,
                optimizer=dp_opt,
                data_loader=loader,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
            )
        rng = np.random.default_rng(1)
        times: dict[str, list[float]] = {"plain": [], "dp": []}
        for step in range(2 * steps + 4):
            batch = records[rng.integers(0, len(records), batch_size)]
            kind = "dp" if step % 2 else "plain"
            if kind == "dp":
                private.enable_hooks()
                model, opt = private, dp_optimizer
            else:
                private.disable_hooks()
                model, opt = lm.model, plain_opt
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            lm_loss(model, batch).backward()
            opt.step()
            if step >= 4:  # the first two of each are warm-up
                times[kind].append(time.perf_counter() - t0)
        private._close()
        for p in lm.model.parameters():
            p.grad = None
        plain_s, dp_s = float(np.median(times["plain"])), float(np.median(times["dp"]))
        out[f"{label}plain_step_s"] = round(plain_s, 4)
        out[f"{label}dpsgd_step_s"] = round(dp_s, 4)
        out[f"{label}ratio"] = round(dp_s / plain_s, 3)
    apply_ffa(lm.model, False)
    return out


# ---------------------------------------------------------------- 3. privacy-utility sweep
def privacy_utility(
    model: str, noise_levels: list[float], rounds: int, clients: int
) -> list[dict[str, Any]]:
    """Federations on `model`: plain, SecAgg+, central DP per noise level, SecAgg+ with DDP."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from server.config import RunConfig
    from server.loop import run_federation
    from server.rundir import MetricsLog
    from simulations.apps import clientapp as client_app

    root = Path(tempfile.mkdtemp(prefix="fedge-privacy-sweep-"))
    base = {
        "model": model,
        "num-server-rounds": rounds,
        "min-available-nodes": clients,
        "min-train-nodes": clients,
        "local-steps": 8,
        "batch-size": 8,
        "seq-len": 64,
        "lr": 0.01,
        "client-eval": False,
        "save-merged": False,
        "server-eval-batches": 16,
        "weighting": "uniform",
        "dp-clip-norm": 0.1,
    }
    factories = "server.privacy.factories:"
    budget = {"privacy-budget": factories + "rdp_budget"}
    runs: dict[str, tuple[float, dict[str, Any]]] = {
        "warm-up": (0.0, {"num-server-rounds": 1}),  # loads the model in every actor; not reported
        "plain": (0.0, {}),
        "secagg": (0.0, {"aggregator": factories + "secagg"}),
    }
    for z in noise_levels:
        if z > 0:
            runs[f"central-dp z={z}"] = (
                z,
                {**budget, "aggregator": factories + "central_dp", "dp-noise-multiplier": z},
            )
    mid = sorted(z for z in noise_levels if z > 0)[len([z for z in noise_levels if z > 0]) // 2]
    runs[f"secagg-ddp z={mid}"] = (
        mid,
        {
            **budget,
            "aggregator": factories + "secagg_distributed_dp",
            "dp-noise-multiplier": mid,
            "dp-min-survival": 1.0,
        },
    )
    configs = {
        label: RunConfig.from_mapping({**base, **extra, "run-dir": str(root / f"run{i}")})
        for i, (label, (_, extra)) in enumerate(runs.items())
    }
    rows: list[dict[str, Any]] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for label, cfg in configs.items():
            outcome = run_federation(grid, cfg)
            if label == "warm-up":
                continue
            history = MetricsLog(outcome.run_dir).rows()
            rounds_s = [float(r["round_seconds"]) for r in history if r["round"] > 0]
            z = runs[label][0]
            rows.append(
                {
                    "run": label,
                    "noise_multiplier": z,
                    "epsilon": round(float(history[-1]["epsilon"]), 3) if z > 0 else None,
                    "initial_perplexity": round(float(history[0]["perplexity"]), 3),
                    "final_perplexity": round(float(history[-1]["perplexity"]), 3),
                    "round_seconds": round(float(np.mean(rounds_s)), 3),
                    "status": outcome.status,
                }
            )
            print(f"sweep {label}: {rows[-1]}", flush=True)

    os.environ["FEDGE_CONCURRENCY"] = "2"
    run_simulation(
        server_app=server_app, client_app=client_app, num_supernodes=clients, backend_config=BACKEND
    )  # type: ignore[arg-type]
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three benchmarks, print and write the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="10,50", help="client counts per round for SecAgg+")
    p.add_argument("--size", type=int, default=100_000, help="floats per client vector")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dpsgd-model", default="zoo:micro")
    p.add_argument("--dpsgd-steps", type=int, default=20)
    p.add_argument("--sweep-model", default="zoo:default")
    p.add_argument("--sweep-noise", default="0,0.3,1,3")
    p.add_argument("--sweep-rounds", type=int, default=4)
    p.add_argument("--sweep-clients", type=int, default=4)
    p.add_argument("--skip", default="", help="comma list of parts to skip: secagg,dpsgd,sweep")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    result: dict[str, Any] = {"bench": "privacy", "vector_size": args.size, "rounds": args.rounds}
    if "secagg" not in skip:
        clients = [int(c) for c in args.clients.split(",")]
        result["secagg"] = secagg_overhead(clients, args.size, args.rounds)
    if "dpsgd" not in skip:
        result["dpsgd"] = dpsgd_overhead(args.dpsgd_model, args.dpsgd_steps, 8, 64)
        print(f"dpsgd: {result['dpsgd']}", flush=True)
    if "sweep" not in skip:
        noise = [float(z) for z in args.sweep_noise.split(",")]
        points = privacy_utility(args.sweep_model, noise, args.sweep_rounds, args.sweep_clients)
        by_run = {p["run"]: p for p in points}
        result["privacy_utility"] = {
            "model": args.sweep_model,
            "clients": args.sweep_clients,
            "rounds": args.sweep_rounds,
            "points": points,
            # a real (micro) federation round: SecAgg+ over plain, training and evaluation included
            "federation_secagg_round_ratio": round(
                by_run["secagg"]["round_seconds"] / by_run["plain"]["round_seconds"], 3
            ),
        }
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result)
    RESULTS_FILE.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
