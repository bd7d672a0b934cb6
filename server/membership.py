"""Who is in the federation this round: connected nodes, each with the partition it serves.

Nodes join and leave during a run (phones come and go; a restarted SuperNode comes
back under a new node id). Every round the loop asks the Grid which nodes are
connected, asks only the newcomers for their partition, forgets the nodes that
left, and samples from the rest. Ordering by (partition, node id) keeps sampling
reproducible across restarts, where node ids change. When two connected nodes
claim one partition (a SuperNode restarted before the SuperLink noticed the old
one was gone), the newer node serves it: the old one is most likely dead. The
federation's size N and the round's sample (K of the connected nodes) are decided here too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

import numpy as np
from flwr.serverapp import Grid

from fedge import keys
from fedge.server.config import RunConfig

log = logging.getLogger(__name__)

PartitionQuery = Callable[[Grid, Sequence[int]], dict[int, int]]
QUERY_CHUNK = 1000  # partition queries per send_and_receive: bounds the messages held at once
POLL_SECONDS = 0.5


class Roster:
    """The connected nodes and their partitions, refreshed at the start of every round.

    ``query`` asks new nodes for their partition, once (a node that does not answer
    is left out until it reconnects, so a dead node costs one query timeout, not
    one per round); None numbers nodes in the order they are first seen, which is
    enough when every node is sampled every round.
    """

    def __init__(self, query: PartitionQuery | None) -> None:
        self._query = query
        self._partition: dict[int, int] = {}  # node id -> partition, for connected nodes
        self._seen: dict[int, int] = {}  # node id -> order of arrival (newer wins a partition)
        self._arrivals = 0
        self._ever: set[int] = set()  # every partition seen so far: the federation's size N

    def refresh(self, grid: Grid, minimum: int, timeout: float) -> list[int]:
        """Connected nodes in (partition, node id) order; wait up to ``timeout`` s for ``minimum``."""
        deadline = time.monotonic() + timeout
        while True:
            ordered = self._update(grid)
            if len(ordered) >= minimum:
                return ordered
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(ordered)} of the {minimum} nodes needed are connected after "
                    f"{timeout:.0f} s; start more SuperNodes or lower min-available-nodes / "
                    "min-train-nodes"
                )
            time.sleep(POLL_SECONDS)

    @property
    def partitions(self) -> Mapping[int, int]:
        """Connected node id -> its partition (a live, read-only view)."""
        return MappingProxyType(self._partition)

    @property
    def partitions_seen(self) -> int:
        """How many distinct partitions (clients) have connected so far: the N of SCAFFOLD and DP
        when the population size is not known (:func:`known_population`)."""
        return len(self._ever)

    def seen(self) -> list[int]:
        """Every partition seen so far, sorted (what a checkpoint keeps, so N survives a resume)."""
        return sorted(self._ever)

    def restore(self, partitions: Iterable[int]) -> None:
        """Count partitions seen before a restart as seen (they may not reconnect, yet they
        were part of the federation whose N the strategy and the accountant use)."""
        self._ever.update(int(p) for p in partitions)

    def partition(self, node_id: int) -> int:
        """The partition a connected node serves."""
        return self._partition[node_id]

    def _update(self, grid: Grid) -> list[int]:
        connected = set(grid.get_node_ids())
        for gone in set(self._seen) - connected:
            del self._seen[gone]
            part = self._partition.pop(gone, None)
            log.info("node %d left the federation (partition %s)", gone, part)
        new = sorted(connected - set(self._seen))
        for node in new:
            self._seen[node] = self._arrivals
            self._arrivals += 1
        if new and self._query is None:
            self._partition.update({n: self._seen[n] for n in new})
        elif new and self._query is not None:
            for i in range(0, len(new), QUERY_CHUNK):
                self._partition.update(self._query(grid, new[i : i + QUERY_CHUNK]))
            silent = [n for n in new if n not in self._partition]
            if silent:
                log.warning("%d new node(s) did not report a partition; left out", len(silent))
        if new:
            self._ever.update(self._partition[n] for n in new if n in self._partition)
            log.info("%d node(s) joined; %d connected", len(new), len(connected))
        return self._dedupe()

    def _dedupe(self) -> list[int]:
        """Order by (partition, node); of two nodes claiming a partition keep the newer."""
        best: dict[int, int] = {}
        for node, part in self._partition.items():
            if part not in best or self._seen[node] > self._seen[best[part]]:
                best[part] = node
        return sorted(best.values(), key=lambda n: (self._partition[n], n))


def known_population(grid: Grid) -> int | None:
    """The population size when the engine knows it (a simulation knows every device it may
    ever connect: ``grid.population_size``), else None (the N is then the partitions seen).

    Grid wrappers expose their inner grid as ``_grid``; the chain is followed to the engine.
    """
    while grid is not None:
        size = getattr(grid, "population_size", None)
        if isinstance(size, int) and size > 0:
            return size
        grid = getattr(grid, "_grid", None)  # type: ignore[assignment]
    return None


def federation_size(grid: Grid, roster: Roster) -> int:
    """N, the federation's client population (SCAFFOLD's 1/N, the accountant's sampling rate):
    the engine's known population size when it has one, else every partition seen so far
    (which grows as clients first connect, so early rounds would overstate each one's share)."""
    return max(known_population(grid) or 0, roster.partitions_seen)


def sample_nodes(
    rng: np.random.Generator, candidates: Sequence[int], population: int, cfg: RunConfig
) -> tuple[int, list[int]]:
    """Return (K, sampled): K reports wanted (``target-reports``, else max(min-train-nodes,
    ceil(fraction-train * population))) and ceil(K * (1 + over-selection)) of the connected
    ``candidates``, in their order."""
    wanted = cfg.target_reports or max(
        cfg.min_train_nodes, math.ceil(cfg.fraction_train * population)
    )
    target = min(len(candidates), wanted)
    n = min(len(candidates), math.ceil(target * (1.0 + cfg.over_selection)))
    picks = sorted(int(i) for i in rng.choice(len(candidates), size=n, replace=False))
    return target, [candidates[i] for i in picks]


def resolve_partition_count(cfg: RunConfig, population: int) -> RunConfig:
    """``num-partitions = 0`` under iid or dirichlet means one partition per connected node, at
    most one per document: more nodes than that train on shards (:mod:`fedge.data.shards`)."""
    if cfg.partition_scheme == "natural" or cfg.num_partitions > 0:
        return cfg
    from fedge.data import load_documents

    documents = len(load_documents(cfg.data_source or None, cfg.max_chars_per_client or None))
    return cfg.with_overrides({keys.CFG_NUM_PARTITIONS: min(population, documents)})
