"""In-process SecAgg+ harness: one server engine, N client engines, drop-outs by silence."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from fedge.clients.secagg.engine import SecAggClientEngine
from fedge.secagg import wire


@dataclass
class Federation:
    """Clients with known contributions; `silent[stage]` lists nodes that stop answering there."""

    contributions: dict[int, dict[str, np.ndarray]]
    silent: dict[str, set[int]] = field(default_factory=dict)
    states: dict[int, ConfigRecord] = field(default_factory=dict)
    received: list[tuple[str, int, RecordDict]] = field(default_factory=list)

    def exchange(self, stage: str, requests: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
        """Deliver each request to its client engine; record every reply the server gets."""
        gone = set()
        for s in wire.STAGES[: wire.STAGES.index(stage) + 1]:
            gone |= self.silent.get(s, set())
        out = {}
        for node, content in requests.items():
            if node in gone:
                continue
            state = self.states.setdefault(node, ConfigRecord())
            engine = SecAggClientEngine(node, state)
            reply = engine.handle(content, lambda node=node: self.contributions[node])
            self.received.append((stage, node, reply))
            out[node] = reply
        return out


def random_contributions(
    num_clients: int, seed: int, size: int = 600
) -> dict[int, dict[str, np.ndarray]]:
    """Contributions shaped like a SCAFFOLD round: adapter delta, control delta, weight, count."""
    rng = np.random.default_rng(seed)
    ids = sorted({int(x) for x in rng.integers(1, 2**62, size=num_clients)})
    ids[0] = 2**64 - 5  # Flower node ids are uint64; exercise the top of the range
    return {
        u: {
            "delta/layer.lora_B": rng.normal(0, 0.05, size=(size // 10, 10)).astype(np.float32),
            "ctrl/layer.lora_B": rng.normal(0, 0.5, size=(size // 10, 10)).astype(np.float32),
            "meta/weight": np.array([1.0], dtype=np.float32),
            "meta/count": np.array([1.0], dtype=np.float32),
        }
        for u in ids
    }


@pytest.fixture
def make_federation() -> Callable[..., Federation]:
    """Return a factory of in-process federations."""

    def make(num_clients: int, seed: int = 0, size: int = 600) -> Federation:
        return Federation(random_contributions(num_clients, seed, size))

    return make
