"""The fedge ServerApp: the round loop of :mod:`fedge.server.loop` behind Flower's ``@app.main()``.

``app`` (what ``[tool.flwr.app.components]`` names) reads its configuration from the
run config, i.e. ``[tool.flwr.app.config]`` plus ``flwr run --run-config``
overrides. ``fedge simulate`` builds its own ServerApp with
:func:`make_server_app`, passing the scenario's resolved config directly, because
Flower's ``run_simulation`` gives the ServerApp an empty run config.

The FAB deploys the production ClientApp (``fedge.clients.app:app``), which never simulates a
device; so under ``flwr run`` the ServerApp refuses the device-simulation keys
(``straggler-fraction``, ``device-population``) instead of silently ignoring them:
simulated devices are ``fedge simulate``'s (``fedge.simulations.apps`` wraps the ClientApp).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedge.server.config import RunConfig
from fedge.server.loop import LoopOutcome, RowCallback, default_run_dir, run_federation
from fedge.server.tracking import round_trackers

log = logging.getLogger(__name__)


@dataclass
class OutcomeBox:
    """Receives the run's outcome from the ServerApp thread (for in-process callers)."""

    outcome: LoopOutcome | None = None
    rows: list[dict[str, object]] = field(default_factory=list)


DEVICE_SIMULATION_KEYS = ("straggler-fraction", "device-population")


def refuse_device_simulation(run_config: Mapping[str, object]) -> None:
    """Raise when a FAB run asks for simulated devices, which only ``fedge simulate`` provides."""
    asked = [k for k in DEVICE_SIMULATION_KEYS if run_config.get(k) not in (None, "", 0, 0.0)]
    if asked:
        raise ValueError(
            f"run config sets {', '.join(asked)}: the FAB's ClientApp (fedge.clients.app:app) is the "
            "production one and simulates no devices; run device simulations with "
            "`fedge simulate` (scenario [config]), or set these keys to their defaults"
        )


def make_server_app(
    cfg: RunConfig | None = None,
    resume: bool = False,
    on_row: RowCallback | None = None,
    box: OutcomeBox | None = None,
    wrap_grid: Callable[[Grid], Grid] | None = None,
) -> ServerApp:
    """Return a ServerApp running the federation with ``cfg`` (None: read the run config).

    ``wrap_grid`` puts a Grid wrapper between the loop and Flower's Grid (simulated devices).
    """
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        if cfg is None:
            refuse_device_simulation(context.run_config)
        config = cfg if cfg is not None else RunConfig.from_mapping(dict(context.run_config))
        if not config.run_dir:  # fix the default now: the loop and the tracker share it
            config = config.with_overrides({"run-dir": str(default_run_dir())})
        if wrap_grid is not None:
            grid = wrap_grid(grid)
        trackers = round_trackers(
            Path(config.run_dir), config.tensorboard, config.mlflow, config.to_mapping()
        )
        failed = True
        try:
            outcome = run_federation(grid, config, resume=resume, on_row=_chain(on_row, *trackers))
            failed = outcome.status == "failed"
        finally:
            for tracker in trackers:
                tracker.close(failed)
        if box is not None:
            box.outcome = outcome
        level = logging.INFO if outcome.status != "failed" else logging.ERROR
        log.log(
            level,
            "fedge federation %s: %s (run dir %s)",
            outcome.status,
            outcome.message,
            outcome.run_dir,
        )

    return server_app


def _chain(*callbacks: RowCallback | None) -> RowCallback | None:
    """One row callback calling each given one in order (None when none is given)."""
    given = [c for c in callbacks if c is not None]
    if not given:
        return None

    def call(row: Mapping[str, Any]) -> None:
        for callback in given:
            callback(row)

    return call


app = make_server_app()
