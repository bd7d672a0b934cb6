"""Device shards: how a population larger than the corpus's partitions gets its data.

The stdlib corpus is cut into ~4,000-character documents, so a partitioner can make
at most a few hundred clients of it; a simulated population of 10,000 phones
cannot each own whole documents. When the population outnumbers the partitions,
device ``d`` of ``N`` takes the ``d``-th of ``N`` equal contiguous slices of all
partitions' train streams laid end to end in partition order. A slice lies within one
partition (one stdlib package under the natural scheme) unless it straddles a
boundary, so the data stays non-IID, and each partition serves a number of devices proportional to
its size: devices draw from shared pools. A slice shorter than ``min_tokens`` is
widened to it (neighbouring devices then overlap). A device evaluates on the
held-out stream of the partition its slice starts in.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from fedge.data.federated import ClientTokens, FederatedCorpus
from fedge.errors import DataError


def device_tokens(
    corpus: FederatedCorpus, device: int, population: int, min_tokens: int
) -> ClientTokens:
    """Device ``device``'s data: its partition, or its slice when ``population`` exceeds the partitions."""
    if not 0 <= device < max(population, 1):
        raise DataError(
            f"partition-id {device} is outside the population of {population} devices "
            "(node config num-partitions); give each node an id in [0, num-partitions)"
        )
    if population <= len(corpus):
        return corpus.client(device)
    sizes = np.array([int(c["train_tokens"]) for c in corpus.clients], dtype=np.int64)
    ends = np.cumsum(sizes)
    start, length = _span(int(ends[-1]), device, population, min_tokens)
    first = int(np.searchsorted(ends, start, side="right"))
    pieces, position, partition = [], start, first
    while position < start + length:
        begin = int(ends[partition] - sizes[partition])
        stop = min(int(ends[partition]), start + length)
        pieces.append(np.asarray(corpus.client(partition).train[position - begin : stop - begin]))
        position, partition = stop, partition + 1
    home = corpus.client(first)
    return ClientTokens(
        client_id=f"{home.client_id}/device-{device}",
        train=np.concatenate(pieces) if len(pieces) > 1 else pieces[0],
        heldout=home.heldout,
    )


def device_pools(corpus: FederatedCorpus, devices: Iterable[int], min_tokens: int = 1) -> list[int]:
    """The partitions whose held-out streams the given devices evaluate on, each once.

    The population is taken as the largest device id + 1 (simulations number devices
    0..N-1), so with only part of a population connected this is an approximation.
    """
    ids = sorted(set(devices))
    if not ids:
        return []
    population = ids[-1] + 1
    if population <= len(corpus):
        return ids
    ends = np.cumsum([int(c["train_tokens"]) for c in corpus.clients])
    starts = [_span(int(ends[-1]), d, population, min_tokens)[0] for d in ids]
    return sorted({int(np.searchsorted(ends, s, side="right")) for s in starts})


def _span(total: int, device: int, population: int, min_tokens: int) -> tuple[int, int]:
    """(start, length) of a device's slice of ``total`` tokens laid end to end."""
    length = min(max(total // population, min_tokens), total)
    return min(device * total // population, total - length), length
