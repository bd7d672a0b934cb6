"""Drive the SecAgg+ stages over any transport that maps requests to replies."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import RecordDict

from fedge.secagg import wire
from fedge.server.secagg.engine import SecAggServerEngine

# (stage, {node: request content}) -> {node: reply content} for the nodes that answered in time
Exchange = Callable[[str, Mapping[int, RecordDict]], Mapping[int, RecordDict]]


def run_secagg(engine: SecAggServerEngine, exchange: Exchange) -> dict[str, np.ndarray]:
    """Run (advertise-keys,) collect-masked-input and unmask; return the unmasked float sum.

    Keys are advertised only by sampled nodes without keys in the engine's key session, so
    a steady-state round is two exchanges (a third when unmask holders stay silent). Raises `SecAggRoundFailed` when too few clients
    answer any stage; then nothing is returned.
    """
    advertise = engine.advertise_requests()
    if advertise:
        engine.receive_public_keys(exchange(wire.STAGE_ADVERTISE, advertise))
    engine.receive_masked_inputs(exchange(wire.STAGE_COLLECT, engine.collect_requests()))
    while True:  # one unmask exchange, another only if asked holders stayed silent
        summed = engine.receive_unmask_shares(exchange(wire.STAGE_UNMASK, engine.unmask_requests()))
        if summed is not None:
            return summed
