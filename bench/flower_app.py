"""Time per round of one Flower app under Flower's FedAvg, fedge's SCAFFOLD and SCAFFOLD + SecAgg+.

The app is examples/flower-scaffold-secagg's (an MLP, Dirichlet(0.3) label skew per node; the
ClientApp is TrainRound around the torch loop behind fedge's mod, so the same ClientApp serves
all three strategies). ONE ServerApp runs every variant on the same grid, in the same run and
the same nodes: blocks of ``--rounds`` rounds per variant in ABBA order (a machine drifting
faster or slower weighs on every variant alike), each block a fresh ``strategy.start`` whose
first round (SecAgg+'s key adverts, the workers' warm-up) is untimed. A round is timed from
the end of one ``aggregate_train`` to the end of the next (evaluation off), which is what a
user's ``flwr run`` waits for per round.

Engines: ``ray`` (Flower's simulation engine, as ``flwr run . local`` runs the app) or
``inprocess`` (``fedge.simulations.inprocess``: no polling, so fedge's own cost shows most).
Goals (issue 32): SCAFFOLD <= 1.05x and SCAFFOLD + SecAgg+ <= 1.2x Flower's FedAvg.

Usage: ``python bench/flower_app.py [--engine ray|inprocess] [--clients 10] [--rounds 5]
[--blocks 4]``. The last line is one JSON object, also written under the engine and client
count in ``bench/results/flower_app.json``, with the load average.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import block_order, loadavg, write_result

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower-scaffold-secagg"
# the example's package for this process and for the Ray workers it starts
sys.path.insert(0, str(EXAMPLE))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.environ.get("PYTHONPATH", ""), str(EXAMPLE)) if p
)
for _k, _v in {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
}.items():
    os.environ.setdefault(_k, _v)

from flwr.app import ArrayRecord, ConfigRecord, Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.serverapp.strategy import Strategy as FlowerStrategy  # noqa: E402
from scaffoldsecagg.task import load_data, make_net, train  # noqa: E402

from fedge.clients.mods import dispatch_mods  # noqa: E402
from fedge.clients.privacy.ledger import STATE_DIR_ENV  # noqa: E402
from fedge.server.secagg.strategy import SecAggPlus  # noqa: E402
from fedge.strategies.client import TrainRound  # noqa: E402
from fedge.strategies.scaffold import Scaffold  # noqa: E402

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "flower_app.json"
VARIANTS = ("flower_fedavg", "scaffold", "scaffold_secagg")
STEPS, LR = 10, 0.05  # the example's run config defaults

client_app = ClientApp(mods=[dispatch_mods])


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    """The example's train handler, its run config fixed (the simulation passes none)."""
    net = make_net()
    fl = TrainRound.start(msg, context, net)
    x, y = load_data(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    train(net, fl, x, y, STEPS, LR)
    return fl.reply(num_examples=len(x), local_steps=STEPS, lr=LR)


def make_strategy(variant: str, nodes: int) -> FlowerStrategy:
    """The one line that differs between the variants (same sampling, evaluation off)."""
    knobs = {"min_train_nodes": nodes, "min_available_nodes": nodes, "fraction_evaluate": 0.0}
    if variant == "flower_fedavg":
        return FedAvg(**knobs)  # type: ignore[arg-type]
    if variant == "scaffold":
        return Scaffold(**knobs)
    return SecAggPlus(Scaffold(**knobs))


def timed_block(grid: Grid, variant: str, nodes: int, rounds: int) -> list[float]:
    """Seconds of rounds 2..rounds+1 of one ``strategy.start`` (round 1 is the warm-up)."""
    strategy = make_strategy(variant, nodes)
    ends: list[float] = []
    aggregate = strategy.aggregate_train

    def timed(server_round: int, replies: Any) -> Any:
        out = aggregate(server_round, replies)
        ends.append(time.perf_counter())
        return out

    strategy.aggregate_train = timed  # type: ignore[method-assign]
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_net().state_dict()),
        num_rounds=rounds + 1,
        train_config=ConfigRecord(),
    )
    return [b - a for a, b in itertools.pairwise(ends)]


def round_times(engine: str, nodes: int, rounds: int, blocks: int) -> dict[str, Any]:
    """Every variant's timed rounds, from one ServerApp on one grid."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    per_block: list[dict[str, Any]] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for block, variant in block_order(VARIANTS, blocks):
            seconds = timed_block(grid, variant, nodes, rounds)
            times[variant].extend(seconds)
            per_block.append({"block": block, "variant": variant, "median_s": _median(seconds)})
            print(f"block {block} {variant}: {[round(s, 4) for s in seconds]}", flush=True)

    with tempfile.TemporaryDirectory(prefix="fedge-bench-flower-app-") as tmp:
        os.environ[STATE_DIR_ENV] = str(Path(tmp) / "keys")  # SecAgg+ identities of this run
        if engine == "ray":
            from fedge.simulations.flower_internals import run_ray_simulation

            backend = {
                "client_resources": {"num_cpus": 1},
                "init_args": {"num_cpus": os.cpu_count() or 2},
            }
            run_ray_simulation(server_app, client_app, nodes, backend)
        else:
            from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

            run_inprocess(
                server_app, InProcessGrid(client_app, DeviceTable(nodes), Path(tmp) / "st")
            )
    return {"times": times, "blocks": per_block}


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4) if values else float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the blocks; print and write the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("ray", "inprocess"), default="ray")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per block")
    p.add_argument("--blocks", type=int, default=4, help="blocks per variant, in ABBA order")
    args = p.parse_args(argv)
    load_before = loadavg()
    started = time.perf_counter()
    out = round_times(args.engine, args.clients, args.rounds, args.blocks)
    medians = {v: _median(out["times"][v]) for v in VARIANTS}
    base = medians["flower_fedavg"]
    result: dict[str, Any] = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.is_file() else {}
    result["bench"] = "flower_app"
    result[f"{args.engine}_{args.clients}"] = {
        "app": "examples/flower-scaffold-secagg (MLP, Dirichlet(0.3)), 10 local SGD steps",
        "rounds_per_block": args.rounds,
        "blocks_per_variant": args.blocks,
        "median_round_s": medians,
        "ratio_scaffold": round(medians["scaffold"] / base, 3),
        "ratio_scaffold_secagg": round(medians["scaffold_secagg"] / base, 3),
        "goals": {"ratio_scaffold": 1.05, "ratio_scaffold_secagg": 1.2},
        "round_s": {v: [round(t, 4) for t in ts] for v, ts in out["times"].items()},
        "blocks": out["blocks"],
        "seconds": round(time.perf_counter() - started, 1),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }
    return write_result(RESULTS_FILE, result)


if __name__ == "__main__":
    main()
