"""The Flower APIs fedge uses that are private or deprecated, in one place, each checked.

1. ``Metadata.message_id`` is read-only; the SuperLink (and Flower's own grids, e.g.
   ``flwr.server.superlink.linkstate.utils``) stamp it by writing ``_message_id``. The
   in-process grid (:mod:`fedge.simulations.inprocess`) plays the SuperLink, so it must stamp ids
   the same way; no public setter exists in Flower 1.42. When Flower renames or moves the
   field, :func:`set_message_id` raises at once (rather than leaving every message with an
   empty id, which would silently merge replies).
2. ``flwr.simulation.run_simulation`` is deprecated since Flower 1.42 ("use `flwr run`"),
   and no supported entry point takes what ``fedge simulate`` passes: a ServerApp object
   built in Python around callbacks (progress rows, the outcome, the device-clock Grid)
   and a ClientApp object. ``flwr run`` takes an app directory and a run config, and
   ``flwr.simulation.run_simulation_process`` serves a SuperLink's runs. So fedge's Ray
   simulations call it only through :func:`run_ray_simulation`, which raises
   :class:`FlowerInternalsChanged` naming this module when Flower removes it or changes its
   arguments.

``tests/strategies/test_flower_integration.py`` fails naming this module on either change.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from flwr.app import Message
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

MESSAGE_ID_FIELD = "_message_id"  # flwr.app.Metadata's storage of message_id (Flower 1.42)


# The arguments fedge passes to flwr.simulation.run_simulation (Flower 1.42).
RUN_SIMULATION_ARGS = ("server_app", "client_app", "num_supernodes", "backend_config")


class FlowerInternalsChanged(RuntimeError):
    """Flower no longer offers a private field or deprecated call fedge uses: update this module."""


def set_message_id(message: Message, message_id: str) -> None:
    """Give ``message`` the id a SuperLink would, checking that Flower reads it back."""
    message.metadata.__dict__[MESSAGE_ID_FIELD] = message_id
    if message.metadata.message_id != message_id:
        raise FlowerInternalsChanged(
            f"flwr.app.Metadata no longer keeps message_id in {MESSAGE_ID_FIELD!r}; update "
            "simulations/flower_internals.py for this Flower version"
        )


def deprecated_run_simulation() -> Any:
    """``flwr.simulation.run_simulation``, checked to take the arguments fedge passes."""
    import flwr.simulation

    run = getattr(flwr.simulation, "run_simulation", None)
    params = set(inspect.signature(run).parameters) if callable(run) else set()
    missing = sorted(set(RUN_SIMULATION_ARGS) - params)
    if run is None or missing:
        raise FlowerInternalsChanged(
            "flwr.simulation.run_simulation (deprecated in Flower 1.42) is gone or no longer takes "
            f"{missing or list(RUN_SIMULATION_ARGS)}; update simulations/flower_internals.py for "
            'this Flower version (or run the scenario with engine = "inprocess")'
        )
    return run


def run_ray_simulation(
    server_app: ServerApp,
    client_app: ClientApp,
    num_supernodes: int,
    backend_config: Mapping[str, Any],
) -> None:
    """Run the app objects on Flower's Ray simulation engine, in this process (see item 2 above)."""
    deprecated_run_simulation()(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_supernodes,
        backend_config=dict(backend_config),
    )
