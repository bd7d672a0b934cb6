"""fedge's log lines in Flower's log: ``flwr run --stream`` and a ServerApp's console show them.

Flower prints through its own logger ``flwr`` (``flwr.common.logger``: its console handler,
which in a ``flwr run`` ServerApp writes to the stream the SuperLink hands to ``--stream``).
fedge's Flower-facing parts (strategies, server, clients, simulations) log through loggers
named ``fedge.<part>....``; :func:`route_to_flower` gives each part a handler that passes its
records, prefixed ``fedge:``, to the handlers of Flower's logger. The records still propagate
to the root logger as before (a user's ``logging.basicConfig``, pytest's caplog), so each is
printed once by Flower's handlers and once by the root's, exactly as Flower's own lines are.

The part loggers default to INFO, like Flower's own, so fedge's settings and round lines
show; Flower's level is respected (``FLWR_LOG_LEVEL``, ``logging.getLogger("flwr")``'s).
The edge service's loggers (``fedge.verifier``, ``fedge.fleet``) are not Flower's: untouched.
"""

from __future__ import annotations

import copy
import logging

FLOWER_LOGGER = "flwr"  # flwr.common.logger.LOGGER_NAME (read by name: no flwr import here)
PARTS = ("fedge.strategies", "fedge.server", "fedge.clients", "fedge.simulations")
PREFIX = "fedge: "


class ToFlower(logging.Handler):
    """Pass each record, its message prefixed with ``fedge:``, to Flower's logger's handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        flower = logging.getLogger(FLOWER_LOGGER)
        if not flower.isEnabledFor(record.levelno) or not flower.handlers:
            return
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: logging's own error path reports it
            self.handleError(record)
            return
        forwarded = copy.copy(record)
        forwarded.msg, forwarded.args = PREFIX + message, None
        for handler in flower.handlers:  # not flower.handle(): the root gets the original
            if forwarded.levelno >= handler.level:
                handler.handle(forwarded)


def route_to_flower() -> None:
    """Route fedge's Flower-facing loggers into Flower's (idempotent; the parts call it)."""
    for name in PARTS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, ToFlower) for h in logger.handlers):
            logger.addHandler(ToFlower())
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
