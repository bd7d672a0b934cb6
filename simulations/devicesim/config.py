"""The ``[devices]`` table of a scenario: which population, the deadline, memory policy, reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedge.simulations.devicesim.availability import PATTERNS
from fedge.simulations.devicesim.tiers import parse_shares
from fedge.simulations.devicesim.workload import DTYPE_BYTES, REFERENCE_MODELS

MEMORY_POLICIES = ("exclude", "shrink")


@dataclass(frozen=True)
class DeviceConfig:
    """Device simulation settings; a field's key in ``[devices]`` is its name with '-' for '_'."""

    population: str = ""  # a CSV/JSON/Parquet file; "" draws from `tiers`
    tiers: str = "flagship:0.15,midrange:0.35,lowend:0.30,laptop:0.15,workstation:0.05"
    fedscale_capacity: str = ""  # FedScale client_device_capacity pickle (instead of the above)
    fedscale_behaviour: str = ""  # FedScale client_behave_trace pickle (availability)
    fedscale_memory_gb: float = 4.0  # FedScale traces have no memory figure
    fedscale_reference_gflops: float = 0.6  # forward GFLOP/sample ms_per_sample times; 0: ours
    size: int = 0  # devices; 0 = one per simulated node
    spread: float = 0.6  # log-normal sigma of per-device figures around tier medians
    horizon_h: float = 168.0  # drawn availability traces cover this long, then repeat
    availability: str = "sessions"  # tiers: "sessions" at any hour, or "diurnal" (phones at night)
    start_h: float = 0.0  # simulated time when round 1 starts (hours into the trace)
    deadline_s: float = 0.0  # a round closes this many simulated seconds after it opens; 0: none
    memory_policy: str = "exclude"  # a device that cannot fit: "exclude" it, or "shrink" its batch
    weight_dtype: str = "fp16"  # base weights on the device
    timing_model: str = ""  # "" times the run's own model; or a reference shape (qwen2.5-0.5b)
    machine_gflops: float = 0.0  # this machine's training GFLOP/s; 0 measures a real step
    target_perplexity: float = 0.0  # report simulated hours until held-out perplexity <= this

    def __post_init__(self) -> None:
        """Validate each setting, naming its key and value."""
        if self.population and (self.fedscale_capacity or self.fedscale_behaviour):
            raise ValueError("[devices]: give population or fedscale-capacity, not both")
        if self.fedscale_behaviour and not self.fedscale_capacity:
            raise ValueError("[devices] fedscale-behaviour needs fedscale-capacity as well")
        if not self.population and not self.fedscale_capacity:
            parse_shares(self.tiers)
        nonnegative = (
            "size",
            "spread",
            "start_h",
            "deadline_s",
            "machine_gflops",
            "target_perplexity",
            "fedscale_reference_gflops",
        )
        for name in nonnegative:
            if getattr(self, name) < 0:
                raise ValueError(f"[devices] {_key(name)} must be >= 0, got {getattr(self, name)}")
        if self.horizon_h <= 0 or self.fedscale_memory_gb <= 0:
            raise ValueError("[devices] horizon-h and fedscale-memory-gb must be > 0")
        if self.availability not in PATTERNS:
            raise ValueError(
                f"[devices] availability must be one of {PATTERNS}, got {self.availability!r}"
            )
        if self.memory_policy not in MEMORY_POLICIES:
            raise ValueError(
                f"[devices] memory-policy must be one of {MEMORY_POLICIES}, got {self.memory_policy!r}"
            )
        if self.weight_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"[devices] weight-dtype must be one of {list(DTYPE_BYTES)}, got {self.weight_dtype!r}"
            )
        if self.timing_model and self.timing_model not in REFERENCE_MODELS:
            raise ValueError(
                f"[devices] timing-model must be '' or one of {list(REFERENCE_MODELS)}, "
                f"got {self.timing_model!r}"
            )

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> DeviceConfig:
        """Build from a ``[devices]`` table; an unknown key is an error listing the known ones."""
        fields = {_key(f.name): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - set(fields))
        if unknown:
            raise ValueError(f"[devices]: unknown key(s) {unknown}; known: {', '.join(fields)}")
        values: dict[str, Any] = {}
        defaults = cls()
        for key, value in table.items():
            kind = type(getattr(defaults, fields[key].name))
            try:
                values[fields[key].name] = kind(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"[devices] {key} must be {kind.__name__}, got {value!r}") from exc
        return cls(**values)

    def to_table(self) -> dict[str, Any]:
        """The table as written to a run directory (every key)."""
        return {_key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}


def _key(name: str) -> str:
    return name.replace("_", "-")
