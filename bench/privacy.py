"""Benchmark privacy costs: SecAgg+ round overhead, DP-SGD step overhead, a privacy-utility sweep.

1. SecAgg+ (ours, Message API) against plain aggregation, at 10 and 50 clients per round,
   and side by side Flower's legacy ``SecAggPlusWorkflow`` against legacy plain FedAvg, all
   on the same vector size, each on Flower's simulation engine (Ray), ratios per pair. Like
   with like: both SecAgg+ use n/2 shares and threshold 2/3, both get one untimed warm-up
   round, both are timed per fit round (send, receive, aggregate).
2. DP-SGD (Opacus) local round (PrivacyEngine + make_private + steps, as a client runs it)
   against the same non-private AdamW round on the zoo model's LoRA.
3. Privacy-utility: central-DP federations at several noise multipliers; epsilon spent vs
   final held-out perplexity, on a zoo and a schedule where plain training improves it.

Usage: ``python bench/privacy.py [--clients 10,50] [--size 100000] [--rounds 3]
[--sweep-model zoo:demo] [--sweep-noise 0,0.3,1,3] [--skip secagg,dpsgd,sweep]``. The last
line of output is one JSON object, also written to ``bench/results/privacy.json`` (parts
skipped keep their last figures); every part records the load average next to its figures.
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
def simulate(server_app: Any, client_app: Any, num_clients: int) -> None:
    """Run ``server_app`` against ``num_clients`` simulated nodes on Flower's Ray engine."""
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_clients,
        backend_config=BACKEND,  # type: ignore[arg-type]
    )


def ours_round_times(num_clients: int, size: int, rounds: int) -> dict[str, Any]:
    """Seconds of each round: plain vs SecAgg+ (legacy's graph: n/2 shares; and our default).

    The loop is ``bench.secagg_rounds.time_rounds``, the one the Deployment Engine bench runs.
    """
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from bench import secagg_rounds

    out: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        out.update(secagg_rounds.time_rounds(grid, num_clients, size, rounds))

    simulate(server_app, secagg_rounds.client_app, num_clients)
    return out


def legacy_round_times(num_clients: int, size: int, rounds: int, secure: bool) -> list[float]:
    """Seconds of each fit round of Flower's legacy workflow, with or without SecAggPlusWorkflow.

    Only the fit phase of each round is timed (send the fit messages, receive, aggregate),
    the same boundary as one ``aggregate`` call of ours; round 1 is the warm-up.
    """
    from flwr.app import Context
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.default_workflows import default_fit_workflow
    from flwr.serverapp import Grid, ServerApp

    from bench.secagg_rounds import HALF, THRESHOLD, vector

    class VectorClient(NumPyClient):  # type: ignore[misc]
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [vector(self.pid, size)], 1, {}

    def client_fn(context: Context):  # type: ignore[no-untyped-def]
        return VectorClient(int(context.node_config["partition-id"])).to_client()

    client_app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod] if secure else [])
    times: list[float] = []
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
            context=context, config=ServerConfig(num_rounds=rounds + 1), strategy=strategy
        )
        fit = (
            SecAggPlusWorkflow(num_shares=HALF, reconstruction_threshold=THRESHOLD)
            if secure
            else default_fit_workflow
        )

        def timed_fit(grid: Grid, ctx: Context) -> None:
            t0 = time.perf_counter()
            fit(grid, ctx)
            times.append(time.perf_counter() - t0)

        DefaultWorkflow(fit_workflow=timed_fit)(grid, legacy)

    simulate(server_app, client_app, num_clients)
    return times[1:]


def secagg_overhead(clients: list[int], size: int, rounds: int) -> dict[str, Any]:
    """Round-time ratios at each client count: ours and legacy, same graph, warm-up, boundary."""
    out: dict[str, Any] = {}
    for n in clients:
        ours = ours_round_times(n, size, rounds)
        legacy_plain = float(np.mean(legacy_round_times(n, size, rounds, secure=False)))
        legacy_secure = float(np.mean(legacy_round_times(n, size, rounds, secure=True)))
        plain = float(np.mean(ours["plain"]))
        half = float(np.mean(ours["secagg_half_shares"]))
        default = float(np.mean(ours["secagg_default_graph"]))
        out[str(n)] = {
            "ours_plain_s": round(plain, 3),
            "ours_secagg_s": round(half, 3),
            "ours_ratio": round(half / plain, 3),
            "ours_default_graph_s": round(default, 3),
            "ours_default_graph_ratio": round(default / plain, 3),
            "legacy_plain_s": round(legacy_plain, 3),
            "legacy_secaggplus_s": round(legacy_secure, 3),
            "legacy_ratio": round(legacy_secure / legacy_plain, 3),
            "ours_secagg_stage_s": ours.get("secagg_half_shares_stages", {}),
            "loadavg": _loadavg(),
        }
        print(f"secagg n={n}: {out[str(n)]}", flush=True)
    return out


def _loadavg() -> str:
    """The 1/5/15-minute load average, recorded next to every figure."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---------------------------------------------------------------- 2. DP-SGD overhead
def dpsgd_overhead(
    model: str, rounds: int, steps: int, batch_size: int, seq_len: int
) -> dict[str, Any]:
    """Seconds per local round: DP-SGD (make_private + steps + unhook) vs the same plain AdamW round.

    Both train the same LoRA tensors of the same peft model in fp32 on the same records;
    a DP-SGD round is exactly what a client runs (``train_dpsgd``: PrivacyEngine and
    make_private every round, Poisson batches, secure noise, accountant). Rounds
    alternate so load from other processes hits both alike; the first of each is warm-up.
    """
    import torch

    from clients.privacy.dpsgd import DPSGDConfig, lm_loss, token_records, train_dpsgd
    from clients.privacy.local import apply_ffa
    from fedge.lm import holder
    from fedge.lm.config import TrainConfig

    cfg = TrainConfig(batch_size=batch_size, seq_len=seq_len, precision="fp32")
    lm = holder.get_lora_model(holder.resolve_model(model), cfg)
    tokens = np.random.default_rng(0).integers(0, 256, size=40 * batch_size * (seq_len + 1))
    records = token_records(tokens, seq_len)
    out: dict[str, Any] = {
        "model": model,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps_per_round": steps,
    }
    for label, ffa in (("", False), ("ffa_", True)):
        apply_ffa(lm.model, ffa)
        dp = DPSGDConfig(noise_multiplier=1.0, max_grad_norm=1.0, ffa_lora=ffa)
        times: dict[str, list[float]] = {"plain": [], "dp": []}
        rng = np.random.default_rng(1)
        for r in range(2 * rounds + 2):
            t0 = time.perf_counter()
            if r % 2:
                train_dpsgd(
                    lm.model,
                    tokens,
                    steps=steps,
                    batch_size=batch_size,
                    seq_len=seq_len,
                    lr=1e-3,
                    dp=dp,
                    state={},
                )
                kind = "dp"
            else:
                params = [p for p in lm.model.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
                lm.model.train()
                for _ in range(steps):
                    batch = records[rng.integers(0, len(records), batch_size)]
                    opt.zero_grad(set_to_none=True)
                    lm_loss(lm.model, batch).backward()
                    opt.step()
                kind = "plain"
            if r >= 2:
                times[kind].append(time.perf_counter() - t0)
        plain_s, dp_s = float(np.median(times["plain"])), float(np.median(times["dp"]))
        out[f"{label}plain_round_s"] = round(plain_s, 4)
        out[f"{label}dpsgd_round_s"] = round(dp_s, 4)
        out[f"{label}ratio"] = round(dp_s / plain_s, 3)
    apply_ffa(lm.model, False)
    return out


# ---------------------------------------------------------------- 3. privacy-utility sweep
def privacy_utility(
    model: str, noise_levels: list[float], rounds: int, clients: int, steps: int, lr: float
) -> list[dict[str, Any]]:
    """Federations on `model`: plain, SecAgg+, central DP per noise level, SecAgg+ with DDP."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

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
        "local-steps": steps,
        "batch-size": 8,
        "seq-len": 64,
        "lr": lr,
        "client-eval": False,
        "save-merged": False,
        "server-eval-batches": 16,
        "weighting": "uniform",
        "dp-clip-norm": 0.1,
        # iid shards of the whole corpus: what clients learn carries to the union held-out set
        # (natural per-package shards overfit it: plain training made it worse)
        "partition-scheme": "iid",
        "num-partitions": clients,
        "max-chars-per-client": 400_000,
        "lora-target-modules": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
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
    simulate(server_app, client_app, clients)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three benchmarks, print and write the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="10,50", help="client counts per round for SecAgg+")
    p.add_argument("--size", type=int, default=100_000, help="floats per client vector")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dpsgd-model", default="zoo:micro")
    p.add_argument("--dpsgd-rounds", type=int, default=4, help="timed local rounds per kind")
    p.add_argument("--dpsgd-steps", type=int, default=30, help="steps per local round")
    p.add_argument("--sweep-model", default="zoo:demo")
    p.add_argument("--sweep-noise", default="0,0.3,1,3")
    p.add_argument("--sweep-rounds", type=int, default=6)
    p.add_argument("--sweep-clients", type=int, default=4)
    p.add_argument("--sweep-steps", type=int, default=24, help="local steps per round")
    p.add_argument("--sweep-lr", type=float, default=0.01)
    p.add_argument("--skip", default="", help="comma list of parts to skip: secagg,dpsgd,sweep")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    # Parts skipped keep their figures from the last run (each part records its own load).
    result: dict[str, Any] = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.is_file() else {}
    result.pop("note", None)
    result.update({"bench": "privacy", "vector_size": args.size, "rounds": args.rounds})
    if "secagg" not in skip:
        clients = [int(c) for c in args.clients.split(",")]
        result["secagg"] = secagg_overhead(clients, args.size, args.rounds)
    if "dpsgd" not in skip:
        result["dpsgd"] = dpsgd_overhead(
            args.dpsgd_model, args.dpsgd_rounds, args.dpsgd_steps, 8, 64
        )
        result["dpsgd"]["loadavg"] = _loadavg()
        print(f"dpsgd: {result['dpsgd']}", flush=True)
    if "sweep" not in skip:
        noise = [float(z) for z in args.sweep_noise.split(",")]
        points = privacy_utility(
            args.sweep_model,
            noise,
            args.sweep_rounds,
            args.sweep_clients,
            args.sweep_steps,
            args.sweep_lr,
        )
        by_run = {p["run"]: p for p in points}
        result["privacy_utility"] = {
            "model": args.sweep_model,
            "clients": args.sweep_clients,
            "rounds": args.sweep_rounds,
            "local_steps": args.sweep_steps,
            "lr": args.sweep_lr,
            "loadavg": _loadavg(),
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
