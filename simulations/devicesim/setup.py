"""Build a run's device simulation before it starts: population, workload, memory fit.

Everything that can be wrong with a population (a malformed file, an unknown tier, too
few devices for the nodes) is found here, before Flower starts.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fedge import keys
from fedge.simulations.devicesim.config import DeviceConfig
from fedge.simulations.devicesim.grid import DeviceSim
from fedge.simulations.devicesim.population import (
    KIND_SPEED,
    Population,
    PopulationError,
    from_fedscale,
    from_tiers,
    load_population,
)
from fedge.simulations.devicesim.tiers import parse_shares
from fedge.simulations.devicesim.workload import (
    REFERENCE_MODELS,
    Workload,
    measure_step_seconds,
    shape_from_model,
)
from fedge.strategies.registry import build_strategy

log = logging.getLogger(__name__)
HOUR = 3600.0
META_BYTES = 8  # meta/weight and meta/count, one float32 each


def build_population(dcfg: DeviceConfig, nodes: int, seed: int) -> Population:
    """The population the config names, with at least one device per node."""
    size = dcfg.size or nodes
    if size < nodes:
        raise PopulationError(f"[devices] size={size} is smaller than the {nodes} simulated nodes")
    horizon = dcfg.horizon_h * HOUR
    if dcfg.fedscale_capacity:
        behaviour = Path(dcfg.fedscale_behaviour) if dcfg.fedscale_behaviour else None
        return from_fedscale(Path(dcfg.fedscale_capacity), behaviour, size, dcfg.fedscale_memory_gb)
    if dcfg.population:
        pop = load_population(
            Path(dcfg.population), size, seed, dcfg.spread, pattern=dcfg.availability
        )
        if len(pop) < nodes:
            raise PopulationError(
                f"{dcfg.population}: {len(pop)} devices for {nodes} simulated nodes; "
                "add rows or lower num-supernodes"
            )
        return pop
    return from_tiers(
        parse_shares(dcfg.tiers), size, seed, dcfg.spread, horizon, pattern=dcfg.availability
    )


def device_optimizer(optimizer: str, strategy: str) -> str:
    """The optimizer a client builds: ``optimizer``, or for "auto" the strategy's own
    (AdamW, SGD for SCAFFOLD), so the memory model counts the optimizer state it will hold."""
    if optimizer != "auto":
        return optimizer
    return build_strategy({keys.CFG_STRATEGY: strategy}).local_optimizer


def build_workload(dcfg: DeviceConfig, run_cfg: Any, needs_machine: bool) -> Workload:
    """The run's local training as a device sees it (own model, or the timing reference)."""
    from fedge.lm import holder

    train = run_cfg.train
    lm = holder.get_lora_model(holder.resolve_model(run_cfg.model), train)
    if dcfg.timing_model:
        shape = REFERENCE_MODELS[dcfg.timing_model]
        lora = shape.lora_params(train.lora_r, train.target_modules)
    else:
        shape = shape_from_model(lm.model)
        lora = int(sum(p.numel() for p in lm.params.values()))
    adapter = 4 * lora
    payloads = 2 if run_cfg.strategy == "scaffold" else 1  # SCAFFOLD also moves c and c_i deltas
    workload = Workload(
        shape,
        lora,
        train.batch_size,
        train.seq_len,
        train.local_steps,
        download_bytes=payloads * adapter,
        upload_bytes=payloads * adapter + META_BYTES,
        optimizer=device_optimizer(train.optimizer, run_cfg.strategy),
        weight_dtype=dcfg.weight_dtype,
        reference_flops=dcfg.fedscale_reference_gflops * 1e9,
    )
    if dcfg.machine_gflops > 0:
        return replace(workload, machine_flops=dcfg.machine_gflops * 1e9)
    if needs_machine:
        seconds, flops = measure_step_seconds(holder.resolve_model(run_cfg.model), train)
        log.info(
            "this machine: %.4f s per training step, %.2f GFLOP/s", seconds, flops / seconds / 1e9
        )
        return workload.with_machine(seconds, flops)
    return workload


def build_sim(dcfg: DeviceConfig, run_cfg: Any, nodes: int) -> DeviceSim:
    """Population, workload and memory fit of one run; errors name what to fix."""
    pop = build_population(dcfg, nodes, run_cfg.seed)
    workload = build_workload(
        dcfg, run_cfg, needs_machine=bool(np.any(pop.compute_kind == KIND_SPEED))
    )
    sim = DeviceSim(
        pop,
        workload,
        deadline_s=dcfg.deadline_s,
        start_s=dcfg.start_h * HOUR,
        shrink=dcfg.memory_policy == "shrink",
    )
    if sim.excluded.any():
        log.warning(
            "%d of %d devices cannot fit the model in memory (need %.2f GB at batch %d); %s",
            int(sim.excluded.sum()),
            len(pop),
            workload.memory_bytes() / 1e9,
            workload.batch,
            "excluded from selection",
        )
    return sim
