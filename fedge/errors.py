"""Exceptions shared by every part of fedge; each message names the bad input and the fix."""


class FedgeError(Exception):
    """Base class for errors fedge raises on purpose."""


class ModelNotFoundError(FedgeError):
    """A model id or directory could not be resolved to weights on this machine."""


class CorruptModelError(FedgeError):
    """A model directory is incomplete or its files do not match its manifest."""


class DataError(FedgeError):
    """Client data is missing, empty, unreadable or malformed."""
