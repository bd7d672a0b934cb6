"""The ClientApp as simulations run it: fedge's ClientApp wrapped by the device-behaviour mod.

The handlers are the deployed ones (``fedge.clients.app``); only the mods differ, so a real
device runs ``fedge.clients.app:app`` and a simulation runs ``fedge.simulations.apps:clientapp``.
It lives in an importable module so Ray actors keep its module-level model cache.
"""

from __future__ import annotations

from flwr.clientapp import ClientApp

from fedge.clients import app as deployed
from fedge.clients.mods import dispatch_mods
from fedge.simulations.devices import device_mod

clientapp = ClientApp(mods=[device_mod, dispatch_mods])
clientapp.query()(deployed.query)
clientapp.train()(deployed.train)
clientapp.evaluate()(deployed.evaluate)
