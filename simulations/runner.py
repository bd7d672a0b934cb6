"""Run the fedge Flower apps in simulation from a scenario file, on one of two engines.

``engine = "ray"`` is Flower's simulation engine (Ray actors; the engine for scale
across machines); ``engine = "inprocess"`` is :mod:`fedge.simulations.inprocess`, which
runs the same ServerApp and ClientApp in this process with no polling and no
per-node objects (the engine for large populations and small workloads on one
machine). A scenario (``simulations/scenarios/<name>.toml``) has two tables:
``[scenario]`` (the simulated population: ``num-supernodes``, ``engine``, Ray
``client-cpus`` and fractional ``client-gpus`` per ClientApp, ``strategies`` run side
by side by default) and ``[config]`` (run-config keys, exactly those of
``[tool.flwr.app.config]``), and optionally ``[devices]``: simulated devices on a
virtual clock (docs/phones.md), and ``[strategy.<name>]``: config keys of one strategy
only (its tuned ``lr``), applied when the run uses it. CLI options override single keys. The resolved config
is written to the run directory, which ``--resume`` reads back, so a run has one
source of truth.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from fedge.names import DATA, MODELS, STATE, roots_for
from fedge.server.config import RunConfig
from fedge.server.rundir import read_config
from fedge.simulations.devices import DeviceBehaviour
from fedge.simulations.devicesim.config import DeviceConfig

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
ENGINES = ("ray", "inprocess")
NODE_STATE_DIR = "node-state"  # the in-process engine's Context.state files, per device
QUIET_ENV = "FEDGE_QUIET"  # "1": Ray workers' logs stay out of the console
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # an existing Ray cluster to join (e.g. "auto" or "10.0.0.1:6379")
_SCENARIO_FILE = "scenario.toml"


@dataclass(frozen=True)
class Scenario:
    """A simulated population plus the run config it trains with."""

    name: str
    description: str
    num_supernodes: int
    client_cpus: float
    client_gpus: float
    config: RunConfig
    devices: DeviceConfig | None = None  # [devices]: simulated devices on a virtual clock
    strategies: str = ""  # strategies `fedge simulate` compares when --strategy is not given
    engine: str = "ray"  # "ray" (Flower's simulation) or "inprocess" (fedge.simulations.inprocess)

    def __post_init__(self) -> None:
        """Validate the population, naming the key."""
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.num_supernodes <= 0:
            raise ValueError(f"num-supernodes must be > 0, got {self.num_supernodes}")
        if self.client_cpus <= 0 or self.client_gpus < 0:
            raise ValueError("client-cpus must be > 0 and client-gpus >= 0")
        if self.config.min_available_nodes > self.num_supernodes:
            raise ValueError(
                f"min-available-nodes={self.config.min_available_nodes} exceeds "
                f"num-supernodes={self.num_supernodes}; lower it or add supernodes"
            )
        DeviceBehaviour.from_config(self.config.extra)  # a bad device key fails before the run

    def scenario_table(self) -> dict[str, Any]:
        """The ``[scenario]`` table as written to a run directory."""
        return {
            "name": self.name,
            "description": self.description,
            "num-supernodes": self.num_supernodes,
            "client-cpus": self.client_cpus,
            "client-gpus": self.client_gpus,
            "strategies": self.strategies,
            "engine": self.engine,
        }


def scenario_path(name_or_path: str) -> Path:
    """Resolve a scenario name (``quick``) or a path to a TOML file, listing the known names."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" and candidate.is_file():
        return candidate
    named = SCENARIO_DIR / f"{name_or_path}.toml"
    if named.is_file():
        return named
    known = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.toml")))
    raise FileNotFoundError(
        f"no scenario {name_or_path!r}; known scenarios: {known}, or pass a .toml path"
    )


def load_scenario(
    name_or_path: str,
    overrides: Mapping[str, Any] | None = None,
    population: Mapping[str, Any] | None = None,
) -> Scenario:
    """Read a scenario file and apply config ``overrides`` and ``population`` overrides."""
    path = scenario_path(name_or_path)
    data = tomllib.loads(path.read_text())
    unknown = sorted(set(data) - {"scenario", "config", "devices", "strategy"})
    if unknown:
        raise ValueError(
            f"{path}: unknown table(s) {unknown}; use [scenario], [config], [devices] and "
            "[strategy.<name>]"
        )
    return _scenario_from_tables(
        path.stem,
        data.get("scenario", {}),
        strategy_config(path, data.get("config", {}), data.get("strategy", {}), overrides),
        overrides,
        population,
        data.get("devices"),
    )


def strategy_config(
    path: Path,
    config: Mapping[str, Any],
    per_strategy: Mapping[str, Any],
    overrides: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``[config]`` with the ``[strategy.<name>]`` keys of the strategy the run will use.

    A scenario that compares strategies tunes each one's own keys there (SCAFFOLD's SGD wants
    another ``lr`` than FedAvg's AdamW); ``overrides`` (the CLI's) still win over both.
    """
    for name, table in per_strategy.items():
        if not isinstance(table, Mapping):
            raise ValueError(f"{path}: [strategy] must hold tables like [strategy.{name}]")
    name = str({**config, **(overrides or {})}.get("strategy", ""))
    return {**config, **per_strategy.get(name, {})}


def _scenario_from_tables(
    name: str,
    table: Mapping[str, Any],
    config: Mapping[str, Any],
    overrides: Mapping[str, Any] | None,
    population: Mapping[str, Any] | None,
    devices: Mapping[str, Any] | None = None,
) -> Scenario:
    table = {**table, **(population or {})}
    return Scenario(
        name=str(table.get("name", name)),
        description=str(table.get("description", "")),
        num_supernodes=int(table.get("num-supernodes", 2)),
        client_cpus=float(table.get("client-cpus", 1)),
        client_gpus=float(table.get("client-gpus", 0.0)),
        engine=str(table.get("engine", "ray")),
        config=RunConfig.from_mapping({**config, **(overrides or {})}),
        devices=DeviceConfig.from_table(devices) if devices is not None else None,
        strategies=str(table.get("strategies", "")),
    )


def load_run_scenario(run_dir: Path, overrides: Mapping[str, Any] | None = None) -> Scenario:
    """Rebuild the scenario of an existing run directory (for ``--resume``)."""
    config = read_config(run_dir)
    scenario_file = run_dir / _SCENARIO_FILE
    table = tomllib.loads(scenario_file.read_text()) if scenario_file.is_file() else {}
    devices = table.pop("devices", None)
    return _scenario_from_tables(run_dir.name, table, config, overrides, None, devices)


def write_scenario_table(run_dir: Path, scenario: Scenario) -> None:
    """Record the population beside the resolved config."""
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{k} = {json.dumps(v)}" for k, v in scenario.scenario_table().items()]
    if scenario.devices is not None:
        lines += ["", "[devices]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in scenario.devices.to_table().items()]
    (run_dir / _SCENARIO_FILE).write_text("\n".join(lines) + "\n")


def backend_config(scenario: Scenario) -> dict[str, Any]:
    """Ray resources: CPUs per ClientApp, and a GPU fraction only when CUDA is present.

    With ``RAY_ADDRESS`` set, the run joins that cluster: Ray refuses ``num_cpus`` /
    ``num_gpus`` for a cluster it did not start, so only the address is passed and the
    cluster's own resources schedule the ClientApps (``client-cpus`` still sizes each).
    """
    import torch

    resources: dict[str, float] = {"num_cpus": scenario.client_cpus}
    if torch.cuda.is_available() and scenario.client_gpus > 0:
        resources["num_gpus"] = scenario.client_gpus
    address = os.environ.get(RAY_ADDRESS_ENV, "").strip()
    init_args: dict[str, Any] = (
        {"address": address} if address else {"num_cpus": os.cpu_count() or 1}
    )
    if os.environ.get(QUIET_ENV) == "1":  # `fedge demo` without --verbose: no worker output
        init_args.update(log_to_driver=False, logging_level="ERROR")
    return {"client_resources": resources, "init_args": init_args}


def client_state_dir(scenario: Scenario, run_dir: Path) -> str:
    """Where clients keep SCAFFOLD's c_i: the scenario's ``client-state-dir`` (on a Ray cluster,
    a directory every node mounts) or else ``<run>/client-state`` (one machine)."""
    return scenario.config.client_state_dir or str(run_dir / "client-state")


@contextmanager
def node_privacy(run_dir: Path, num_nodes: int) -> Iterator[None]:
    """Every simulated node keeps its privacy state (ledger, identity, pins) under
    ``<run>/privacy-state`` unless ``FEDGE_PRIVACY_STATE_DIR`` says where, and trusts exactly
    the simulated nodes: their identity keys are made here and listed in
    ``<run>/secagg-trust.txt`` (``FEDGE_SECAGG_TRUSTED_KEYS``, unless set), so the simulated
    default is the protected one. Restored afterwards."""
    from fedge.clients.privacy.ledger import STATE_DIR_ENV
    from fedge.clients.secagg.mod import TRUST_ENV, write_trust_list

    with restored_env(STATE_DIR_ENV, TRUST_ENV) as saved:
        root = Path(saved[STATE_DIR_ENV] or run_dir / "privacy-state").absolute()
        os.environ[STATE_DIR_ENV] = str(root)
        if not saved[TRUST_ENV]:
            trust = write_trust_list(root, range(num_nodes), run_dir / "secagg-trust.txt")
            os.environ[TRUST_ENV] = str(trust.absolute())
        yield


@contextmanager
def restored_env(*names: str) -> Iterator[dict[str, str | None]]:
    """Yield the current values of `names`; afterwards set them back (unset if they were)."""
    saved = {env: os.environ.get(env) for env in names}
    try:
        yield saved
    finally:
        for env, value in saved.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value


@contextmanager
def client_roots(cfg: RunConfig) -> Iterator[None]:
    """Every simulated node is this operator's: its data, model and state roots are the
    directories of the run's paths (:func:`fedge.names.roots_for`), through the environment the
    engine's workers inherit; restored afterwards. On a Ray cluster each node sets its own."""
    with restored_env(DATA.env, MODELS.env, STATE.env):
        os.environ.update(roots_for(cfg.to_mapping()))
        yield


def run_simulation(
    scenario: Scenario,
    run_dir: Path,
    resume: bool = False,
    on_row: Callable[[Mapping[str, Any]], None] | None = None,
    client_app: Any = None,
) -> Any:
    """Run the scenario's federation on its engine; return the loop outcome.

    ``client_app`` defaults to :data:`fedge.simulations.apps.clientapp`; it must live in an importable
    module so Ray actors import it (and keep its module-level cache).
    """
    from fedge.server.app import OutcomeBox, make_server_app

    if client_app is None:
        from fedge.simulations.apps import clientapp as client_app

    cfg = scenario.config.with_overrides(
        {"run-dir": str(run_dir), "client-state-dir": client_state_dir(scenario, run_dir)}
    )
    write_scenario_table(run_dir, scenario)
    devices = DeviceRun.start(scenario, cfg, run_dir, resume) if scenario.devices else None
    if devices is not None:
        on_row = devices.rows_to(on_row)
    box = OutcomeBox()
    server_app = make_server_app(
        cfg,
        resume=resume,
        on_row=on_row,
        box=box,
        wrap_grid=devices.wrap if devices is not None else None,
    )
    with client_roots(cfg), node_privacy(run_dir, scenario.num_supernodes):
        if scenario.engine == "inprocess":
            _run_inprocess(scenario, run_dir, resume, server_app, client_app, cfg.seed)
        else:
            from fedge.simulations.flower_internals import run_ray_simulation

            concurrency = max(1, int((os.cpu_count() or 1) // scenario.client_cpus))
            os.environ["FEDGE_CONCURRENCY"] = str(min(concurrency, scenario.num_supernodes))
            run_ray_simulation(
                server_app, client_app, scenario.num_supernodes, backend_config(scenario)
            )
    if devices is not None:
        devices.finish(run_dir)
    return box.outcome


@dataclass
class DeviceRun:
    """A scenario's simulated devices: built (and validated) before the run, reported after it."""

    sim: Any  # fedge.simulations.devicesim.grid.DeviceSim
    config: DeviceConfig
    run_config: RunConfig

    run_dir: Path

    @classmethod
    def start(cls, scenario: Scenario, cfg: RunConfig, run_dir: Path, resume: bool) -> DeviceRun:
        """Build the population, workload and memory fit (a malformed population fails here);
        on ``resume``, continue the clock and counters of the checkpointed round."""
        from fedge.server.checkpoint import latest_round
        from fedge.simulations.devicesim.setup import build_sim

        assert scenario.devices is not None
        sim = build_sim(scenario.devices, cfg, scenario.num_supernodes)
        run = cls(sim, scenario.devices, cfg, run_dir)
        last = latest_round(run_dir) if resume else None
        if last:
            state = run.state_path(last)
            if not state.is_file():
                raise FileNotFoundError(
                    f"{state} is missing: the device clock of round {last} cannot be restored; "
                    "start a fresh run"
                )
            sim.load(state)
        return run

    def state_path(self, server_round: int) -> Path:
        """Where the device state after ``server_round`` is kept."""
        return self.run_dir / "devices" / "state" / f"round_{server_round:04d}.npz"

    def rows_to(
        self, on_row: Callable[[Mapping[str, Any]], None] | None
    ) -> Callable[[Mapping[str, Any]], None]:
        """An ``on_row`` that first closes the round on the device clock and saves its state."""

        def row(metrics: Mapping[str, Any]) -> None:
            r = int(metrics["round"])
            if r > 0:
                self.sim.end_round()
                self.sim.save(self.state_path(r))
                old = self.state_path(r - 2)
                old.unlink(missing_ok=True)
            if on_row is not None:
                on_row(metrics)

        return row

    def wrap(self, grid: Any) -> Any:
        """The Grid the round loop talks to: Flower's, on the devices' virtual clock."""
        from fedge.simulations.devicesim.grid import DeviceGrid, partitions_by_query

        return DeviceGrid(grid, self.sim, partitions_by_query(self.run_config))

    def finish(self, run_dir: Path) -> dict[str, Any]:
        """Close the last round and write the device reports into ``<run>/devices``."""
        from fedge.server.rundir import MetricsLog
        from fedge.simulations.devicesim.report import write_reports

        self.sim.end_round()
        return write_reports(
            self.sim,
            run_dir,
            MetricsLog(run_dir).rows(),
            self.config.start_h * 3600.0,
            self.config.target_perplexity,
        )


def _run_inprocess(
    scenario: Scenario, run_dir: Path, resume: bool, server_app: Any, client_app: Any, seed: int
) -> None:
    """One ClientApp call at a time in this process, so torch gets every core."""
    import shutil

    from fedge.simulations.inprocess import run_inprocess

    os.environ["FEDGE_CONCURRENCY"] = "1"
    state_dir = run_dir / NODE_STATE_DIR
    if not resume:  # a fresh run never sees the node states of an earlier run here
        shutil.rmtree(state_dir, ignore_errors=True)
    run_inprocess(server_app, inprocess_grid(scenario, client_app, state_dir, seed))


def inprocess_grid(
    scenario: Scenario,
    client_app: Any,
    state_dir: Path,
    seed: int,
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """The in-process engine's Grid for a scenario: with simulated devices the virtual clock
    decides who reports, so the wall-clock round timeout (machine speed) drops nobody."""
    from fedge.simulations.inprocess import DeviceTable, InProcessGrid

    return InProcessGrid(
        client_app,
        DeviceTable(scenario.num_supernodes, seed=seed),
        state_dir,
        clock=clock,
        wall_clock_timeout=scenario.devices is None,
    )
