"""Simulated device behaviour: device classes and stragglers that cap a client's local work.

This is a simulation concern: the ClientApp deployed on a real device knows nothing of
it. :func:`device_mod` wraps the ClientApp (a Flower mod) and writes the round's step
budget (``step-budget``) into each train message, never above a budget already there
(the virtual clock's deadline cut, :mod:`fedge.simulations.devicesim.grid`); the ClientApp honours the budget the
same way it would honour one set by a real device. The keys below ride in the run
config as plug-in keys (``device-`` / ``straggler-`` prefixes, see ``fedge.server.config``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge import keys
from fedge.lm.config import derive_seed
from fedge.types import ConfigValue

CFG_STRAGGLER_FRACTION = "straggler-fraction"  # chance per round that a client is a straggler
CFG_STRAGGLER_WORK = "straggler-work"  # fraction of local steps a straggler completes
CFG_DEVICE_POPULATION = "device-population"  # "name:share:work,..." device classes


@dataclass(frozen=True)
class DeviceClass:
    """A class of devices: its share of the population and the fraction of local work it finishes."""

    name: str
    share: float
    work: float


def parse_population(spec: str) -> list[DeviceClass]:
    """Parse "name:share:work,..." (shares need not sum to 1; they are normalised)."""
    classes = []
    for item in (p.strip() for p in spec.split(",") if p.strip()):
        parts = item.split(":")
        try:
            name, share, work = parts[0], float(parts[1]), float(parts[2])
        except (IndexError, ValueError) as exc:
            raise ValueError(
                f"device-population entry {item!r} must look like 'phone:0.5:0.25' "
                "(name:share:work)"
            ) from exc
        if share <= 0 or not 0 < work <= 1:
            raise ValueError(f"device-population entry {item!r}: need share > 0 and work in (0, 1]")
        classes.append(DeviceClass(name, share, work))
    return classes


@dataclass(frozen=True)
class DeviceBehaviour:
    """How simulated devices cap local work: a population of classes plus per-round stragglers."""

    population: str = ""  # "name:share:work,...": device classes, work = fraction of steps
    straggler_fraction: float = 0.0
    straggler_work: float = 0.25

    def __post_init__(self) -> None:
        """Validate ranges, naming the key and the value."""
        if not 0 <= self.straggler_fraction <= 1:
            raise ValueError(f"straggler-fraction must be in [0, 1], got {self.straggler_fraction}")
        if not 0 < self.straggler_work <= 1:
            raise ValueError(f"straggler-work must be in (0, 1], got {self.straggler_work}")
        parse_population(self.population)

    @classmethod
    def from_config(cls, config: Mapping[str, ConfigValue]) -> DeviceBehaviour:
        """Read the device keys of a flat config (absent keys keep their defaults)."""
        try:
            return cls(
                population=str(config.get(CFG_DEVICE_POPULATION, "")),
                straggler_fraction=float(config.get(CFG_STRAGGLER_FRACTION, 0.0)),
                straggler_work=float(config.get(CFG_STRAGGLER_WORK, 0.25)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"device simulation keys: {exc}") from exc

    @property
    def active(self) -> bool:
        """Whether any client can do less than its full local work."""
        return bool(self.population.strip()) or self.straggler_fraction > 0


def device_class(spec: str, seed: int, partition: int) -> DeviceClass | None:
    """Return this client's device class (fixed for the run), or None without a population."""
    classes = parse_population(spec)
    if not classes:
        return None
    shares = np.array([c.share for c in classes])
    draw = np.random.default_rng(derive_seed(seed, "device", partition)).random()
    return classes[int(np.searchsorted(np.cumsum(shares / shares.sum()), draw, side="right"))]


def local_work(
    behaviour: DeviceBehaviour, local_steps: int, seed: int, server_round: int, partition: int
) -> int:
    """Return the steps this client runs this round, reproducibly (at least 1).

    The device class caps the work for the whole run; on top, a client straggles in a
    round with probability ``straggler-fraction`` and then does ``straggler-work`` of it.
    """
    work = 1.0
    cls = device_class(behaviour.population, seed, partition)
    if cls is not None:
        work = cls.work
    if behaviour.straggler_fraction > 0:
        rng = np.random.default_rng(derive_seed(seed, "straggler", server_round, partition))
        if rng.random() < behaviour.straggler_fraction:
            work = min(work, behaviour.straggler_work)
    if work >= 1.0:
        return local_steps
    return max(1, min(local_steps - 1, math.floor(local_steps * work)))


def device_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: set this round's ``step-budget`` in a train message from the device keys."""
    config = msg.content.config_records.get(keys.REC_CONFIG) if msg.has_content() else None
    if msg.metadata.message_type.startswith("train") and config is not None:
        behaviour = DeviceBehaviour.from_config(config)  # type: ignore[arg-type]
        partition = context.node_config.get(keys.NODE_PARTITION_ID)
        if behaviour.active and partition is not None:
            budget = local_work(
                behaviour,
                int(config.get(keys.CFG_LOCAL_STEPS, 1)),  # type: ignore[arg-type]
                int(config.get(keys.CFG_SEED, 0)),  # type: ignore[arg-type]
                int(config.get(keys.CFG_SERVER_ROUND, 1)),  # type: ignore[arg-type]
                int(partition),
            )
            config[keys.CFG_STEP_BUDGET] = tighter_budget(config.get(keys.CFG_STEP_BUDGET), budget)
    return call_next(msg, context)


def tighter_budget(given: object, own: int) -> int:
    """The smaller of a ``step-budget`` already set (by the virtual clock's deadline) and this
    device's own: a mod must never hand back steps the deadline took away (0 = none set)."""
    earlier = int(given) if isinstance(given, int | float) and given > 0 else 0
    return min(earlier, own) if earlier else own
