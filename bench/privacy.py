"""Benchmark privacy costs: SecAgg+ round overhead, DP-SGD step overhead, a privacy-utility sweep.

1. SecAgg+ (ours, Message API) against plain aggregation, at 10 and 50 clients per round,
   and side by side Flower's legacy ``SecAggPlusWorkflow`` against legacy plain FedAvg, all
   on the same vector size, each on Flower's simulation engine (Ray), ratios per pair. Like
   with like: both SecAgg+ use n/2 shares and threshold 2/3, both get one untimed warm-up
   round, both are timed per fit round (send, receive, aggregate).
2. DP-SGD (Opacus) local round (PrivacyEngine + make_private + steps, as a client runs it)
   against the same non-private AdamW round on the zoo model's LoRA.
3. Privacy-utility (``bench/privacy_sweep.py``): the demo's federation plain, under SecAgg+,
   central DP and SecAgg+ with distributed DP at several noise multipliers; epsilon against
   the participants' held-out perplexity, a table in the JSON and a plot in
   ``bench/results/privacy_utility.png``. The sweep splits into parts (``--sweep-baselines``,
   ``--sweep-noise``, ``--sweep-ddp-noise``): each run's row replaces the row of that label.

Usage: ``python bench/privacy.py [--clients 10,50] [--size 100000] [--rounds 3]
[--sweep-noise 0.05,0.5] [--sweep-ddp-noise 0.5] [--sweep-baselines plain,secagg]
[--skip secagg,dpsgd,sweep]``. The last line of output is one JSON object, also written to
``bench/results/privacy.json`` (parts skipped keep their last figures); every part records
the load average next to its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import loadavg, write_result

for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}.items():
    os.environ.setdefault(_k, _v)

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "privacy.json"
PLOT_FILE = RESULTS_FILE.with_name("privacy_utility.png")
BACKEND = {"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": os.cpu_count() or 2}}


# ---------------------------------------------------------------- 1. SecAgg+ overhead
def simulate(server_app: Any, client_app: Any, num_clients: int) -> None:
    """Run ``server_app`` against ``num_clients`` simulated nodes on Flower's Ray engine."""
    from fedge.simulations.flower_internals import run_ray_simulation

    run_ray_simulation(server_app, client_app, num_clients, BACKEND)


def ours_round_times(
    num_clients: int,
    size: int,
    rounds: int,
    variants: tuple[str, ...] | None = None,
) -> dict[str, Any]:
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
        chosen = secagg_rounds.VARIANTS if variants is None else variants
        out.update(secagg_rounds.time_rounds(grid, num_clients, size, rounds, chosen))

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
            "loadavg": loadavg(),
        }
        print(f"secagg n={n}: {out[str(n)]}", flush=True)
    return out


# ---------------------------------------------------------------- 2. DP-SGD overhead
def dpsgd_overhead(
    model: str, rounds: int, steps: int, batch_size: int, seq_len: int
) -> dict[str, Any]:
    """Seconds per local round: DP-SGD (make_private + steps + unhook) vs the same plain AdamW round.

    Both train the same LoRA tensors of the same peft model in fp32 on the same records;
    a DP-SGD round is exactly what a client runs (``train_dpsgd``: PrivacyEngine and
    make_private every round, Poisson batches, secure noise, accountant). A DP-SGD round
    of 0 steps times the per-round fixed cost (make_private, unhook, accountant) alone.
    Poisson batches vary in size (mean ``batch_size``), so a round must have enough steps
    that their total is close to ``steps * batch_size`` (100 steps: within about 3.5%,
    one standard deviation). Kinds alternate so other load hits all alike; the first of
    each is warm-up; medians are reported.
    """
    import torch

    from fedge.clients.privacy.dpsgd import DPSGDConfig, lm_loss, token_records, train_dpsgd
    from fedge.clients.privacy.local import apply_ffa
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
        times: dict[str, list[float]] = {"plain": [], "dp": [], "fixed": []}
        rng = np.random.default_rng(1)
        kinds = ("plain", "dp", "fixed")  # fixed: a DP-SGD round of 0 steps (make_private, unhook)
        for r in range(len(kinds) * (rounds + 1)):
            kind = kinds[r % len(kinds)]
            t0 = time.perf_counter()
            if kind == "plain":
                params = [p for p in lm.model.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
                lm.model.train()
                for _ in range(steps):
                    batch = records[rng.integers(0, len(records), batch_size)]
                    opt.zero_grad(set_to_none=True)
                    lm_loss(lm.model, batch).backward()
                    opt.step()
            else:
                train_dpsgd(
                    lm.model,
                    tokens,
                    steps=steps if kind == "dp" else 0,
                    batch_size=batch_size,
                    seq_len=seq_len,
                    lr=1e-3,
                    dp=dp,
                    state={},
                )
            if r >= len(kinds):  # the first of each kind is the warm-up
                times[kind].append(time.perf_counter() - t0)
        plain_s, dp_s = float(np.median(times["plain"])), float(np.median(times["dp"]))
        fixed_s = float(np.median(times["fixed"]))
        out[f"{label}plain_round_s"] = round(plain_s, 4)
        out[f"{label}dpsgd_round_s"] = round(dp_s, 4)
        out[f"{label}ratio"] = round(dp_s / plain_s, 3)
        out[f"{label}make_private_s"] = round(fixed_s, 4)  # per round, included in dpsgd_round_s
        out[f"{label}step_ratio"] = round((dp_s - fixed_s) / plain_s, 3)
    apply_ffa(lm.model, False)
    return out


def privacy_utility(previous: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run the sweep's chosen runs; merge them into the earlier rows by label; plot them all."""
    from bench import privacy_sweep

    def floats(text: str) -> list[float]:
        return [float(z) for z in text.split(",") if z]

    runs = privacy_sweep.run_specs(
        [b for b in args.sweep_baselines.split(",") if b],
        floats(args.sweep_noise),
        floats(args.sweep_ddp_noise),
    )
    fresh = privacy_sweep.sweep(runs)
    by_run = {p["run"]: p for p in previous.get("points", []) if "participants_perplexity" in p}
    by_run.update({p["run"]: p for p in fresh})
    points = sorted(by_run.values(), key=lambda p: (p["epsilon"] is not None, -(p["epsilon"] or 0)))
    out: dict[str, Any] = {
        "setting": "demo scenario: zoo:demo, 6 clients (natural partitions), 4 rounds x 20 "
        "steps, LoRA r16 all linear layers, lr 0.01, uniform weighting, clip 0.1, in-process",
        "points": points,
        "plot": str(privacy_sweep.plot(points, PLOT_FILE).relative_to(RESULTS_FILE.parents[1])),
    }
    if "plain" in by_run and "secagg" in by_run:  # a real LoRA round, training and eval included
        out["federation_secagg_round_ratio"] = round(
            by_run["secagg"]["round_seconds"] / by_run["plain"]["round_seconds"], 3
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three benchmarks, print and write the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="10,50", help="client counts per round for SecAgg+")
    p.add_argument("--size", type=int, default=100_000, help="floats per client vector")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dpsgd-model", default="zoo:micro")
    p.add_argument("--dpsgd-rounds", type=int, default=3, help="timed local rounds per kind")
    p.add_argument("--dpsgd-steps", type=int, default=100, help="steps per local round")
    p.add_argument("--sweep-baselines", default="plain,secagg", help="of plain,secagg")
    p.add_argument("--sweep-noise", default="0.05,0.15,0.5,1.5", help="central-DP z values")
    p.add_argument("--sweep-ddp-noise", default="0.15,0.5", help="distributed-DP z values")
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
        result["dpsgd"]["loadavg"] = loadavg()
        print(f"dpsgd: {result['dpsgd']}", flush=True)
    if "sweep" not in skip:
        result["privacy_utility"] = privacy_utility(result.get("privacy_utility", {}), args)
    return write_result(RESULTS_FILE, result)


if __name__ == "__main__":
    main()
