"""Timed vector rounds, plain vs SecAgg+, shared by the simulation and Deployment Engine benches.

The ClientApp answers every train message with a fixed random vector per partition (size
from the message config), so a round costs only the protocol and Flower's transport. The
timing loop gives every aggregator one untimed warm-up round (imports, worker caches, the
once-per-run SecAgg+ key advertisement), then times ``rounds`` ``aggregate`` calls: send the
train messages, receive, sum. ``server_app`` runs the same loop under the Deployment
Engine, configured by the run config (``x-clients``, ``x-size``, ``x-rounds``,
``x-variants``, ``x-out``) and writing the timings as JSON to ``x-out``.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp import Grid, ServerApp

from fedge import keys
from fedge.clients.mods import dispatch_mods
from fedge.secagg import wire

if TYPE_CHECKING:
    from fedge.server.aggregation import Aggregator

SIZE_KEY = "x-size"  # train-config key: floats per client vector
HALF, THRESHOLD = 0.5, 2 / 3  # legacy SecAggPlusWorkflow's graph: n/2 shares, threshold 2/3
STAGE_TIMEOUT_S = 600.0  # a loaded machine starts workers slowly; a round never waits this long
VARIANTS = ("plain", "secagg_half_shares", "secagg_default_graph")
# A folder: each ClientApp process appends "stage wall_s cpu_s" per message to <pid>.tsv there.
CLIENT_TIMES_ENV = "FEDGE_BENCH_CLIENT_TIMES"


def vector(pid: int, size: int) -> np.ndarray:
    """The contribution of partition ``pid``: small values well inside the clipping range."""
    return np.random.default_rng(pid).normal(0, 0.01, size).astype(np.float32)


def timing_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """When ``CLIENT_TIMES_ENV`` names a folder, log the wall and CPU seconds of each message
    of the timed rounds (the warm-up round's group id is "0")."""
    folder = os.environ.get(CLIENT_TIMES_ENV)
    if not folder or msg.metadata.group_id == "0":
        return call_next(msg, context)
    wall, cpu = time.perf_counter(), time.process_time()
    reply = call_next(msg, context)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rec = msg.content.config_records.get(wire.SECAGG_RECORD)
    stage = str(rec.get(wire.KEY_STAGE)) if rec is not None else "plain"
    with open(Path(folder) / f"{os.getpid()}.tsv", "a") as log:
        log.write(f"{stage}\t{wall:.6f}\t{cpu:.6f}\n")
    return reply


client_app = ClientApp(mods=[timing_mod, dispatch_mods])


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Reply with this partition's vector (no training: the round measures the protocol)."""
    pid = int(context.node_config["partition-id"])
    size = int(msg.content.config_records[keys.REC_CONFIG][SIZE_KEY])  # type: ignore[arg-type]
    arrays = {
        "delta/v": vector(pid, size),
        "meta/weight": np.ones(1, np.float32),
        "meta/count": np.ones(1, np.float32),
    }
    record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    return Message(RecordDict({keys.REC_CONTRIB: record}), reply_to=msg)


def aggregator(name: str) -> Aggregator:
    """The aggregator a variant name stands for.

    Server code is imported here, not at the top: the Deployment Engine starts a fresh
    ClientApp process per message, which should not pay for the server's imports (torch).
    """
    from fedge.secagg.config import SecAggConfig
    from fedge.server.aggregation import PlainAggregator
    from fedge.server.secagg.aggregator import SecAggPlusAggregator

    if name == "plain":
        return PlainAggregator()
    if name == "secagg_half_shares":
        cfg = SecAggConfig(
            num_shares=HALF, reconstruction_threshold=THRESHOLD, stage_timeout_s=STAGE_TIMEOUT_S
        )
        return SecAggPlusAggregator(cfg)
    if name == "secagg_default_graph":
        return SecAggPlusAggregator(SecAggConfig(stage_timeout_s=STAGE_TIMEOUT_S))
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def time_rounds(
    grid: Grid, num_clients: int, size: int, rounds: int, variants: Sequence[str] = VARIANTS
) -> dict[str, Any]:
    """Per variant: the seconds of each timed round and the mean seconds of each SecAgg+ stage."""
    while len(list(grid.get_node_ids())) < num_clients:
        time.sleep(0.2)
    nodes = sorted(grid.get_node_ids())
    spec: dict[str, tuple[int, ...]] = {"delta/v": (size,), "meta/weight": (1,), "meta/count": (1,)}
    content = RecordDict(
        {keys.REC_CONFIG: ConfigRecord({keys.CFG_CLIENT_MODS: "", SIZE_KEY: size})}
    )
    out: dict[str, Any] = {}
    try:
        for name in variants:
            out.update(_time_variant(grid, name, nodes, content, spec, rounds))
    finally:
        gc.unfreeze()
    return out


def _time_variant(
    grid: Grid,
    name: str,
    nodes: list[int],
    content: RecordDict,
    spec: dict[str, tuple[int, ...]],
    rounds: int,
) -> dict[str, Any]:
    """One variant: an untimed warm-up, then ``rounds`` timed rounds.

    After the warm-up every object alive is moved out of the collector's reach
    (``gc.freeze``): a full collection over the server process's heap (Ray, Flower,
    numpy; torch where imported) holds the GIL for 0.1-0.3 s, and where one fell depended
    on allocation counts, not on the variant: the first timed SecAgg+ round took 0.44 and
    0.55 s with the collector on and 0.21 and 0.20 s with it off (10 clients, load 1.6).
    """
    out: dict[str, Any] = {}
    agg = aggregator(name)
    agg.aggregate(grid, 0, nodes, content, spec, STAGE_TIMEOUT_S)  # warm-up, untimed
    gc.collect()
    gc.freeze()
    times: list[float] = []
    stages: dict[str, float] = {}
    for r in range(rounds):
        t0 = time.perf_counter()
        result = agg.aggregate(grid, r + 1, nodes, content, spec, STAGE_TIMEOUT_S)
        times.append(time.perf_counter() - t0)
        if result.summed is None:
            raise RuntimeError(f"{name} round failed: {result.rejected}")
        for stage, sec in getattr(agg, "last_stage_seconds", {}).items():
            stages[stage] = stages.get(stage, 0.0) + sec / rounds
    out[name] = times
    if stages:
        out[f"{name}_stages"] = {k: round(v, 3) for k, v in stages.items()}
    return out


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Deployment Engine entry: time the variants the run config names; write JSON to x-out."""
    cfg = context.run_config
    variants = [v for v in str(cfg["x-variants"]).split(",") if v]
    out = time_rounds(
        grid, int(cfg["x-clients"]), int(cfg["x-size"]), int(cfg["x-rounds"]), variants
    )  # type: ignore[arg-type]
    Path(str(cfg["x-out"])).write_text(json.dumps(out))
