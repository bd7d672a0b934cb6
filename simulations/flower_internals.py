"""The one place fedge writes a private Flower field, checked so a Flower change fails loudly.

Flower's ``Metadata.message_id`` is read-only; the SuperLink (and Flower's own grids,
e.g. ``flwr.server.superlink.linkstate.utils``) stamp it by writing ``_message_id``.
The in-process grid (:mod:`simulations.inprocess`) plays the SuperLink, so it must
stamp ids the same way. No public setter exists in Flower 1.42. When Flower renames
or moves the field, :func:`set_message_id` raises at once (rather than leaving every
message with an empty id, which would silently merge replies), and
``tests/strategies/test_flower_internals.py`` fails naming this module.
"""

from __future__ import annotations

from flwr.app import Message

MESSAGE_ID_FIELD = "_message_id"  # flwr.app.Metadata's storage of message_id (Flower 1.42)


class FlowerInternalsChanged(RuntimeError):
    """Flower no longer stores a field where this module writes it: update this module."""


def set_message_id(message: Message, message_id: str) -> None:
    """Give ``message`` the id a SuperLink would, checking that Flower reads it back."""
    message.metadata.__dict__[MESSAGE_ID_FIELD] = message_id
    if message.metadata.message_id != message_id:
        raise FlowerInternalsChanged(
            f"flwr.app.Metadata no longer keeps message_id in {MESSAGE_ID_FIELD!r}; update "
            "simulations/flower_internals.py for this Flower version"
        )
