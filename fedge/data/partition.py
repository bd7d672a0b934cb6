"""Assign documents to clients with flwr-datasets partitioners over their labels."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fedge.data.sources import Document

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

Scheme = Literal["natural", "iid", "dirichlet"]
SCHEMES: tuple[str, ...] = ("natural", "iid", "dirichlet")


@dataclass(frozen=True)
class PartitionSpec:
    """How to split documents: by natural label, uniformly, or Dirichlet(alpha) over labels."""

    scheme: str = "natural"
    num_partitions: int | None = None  # iid/dirichlet; default: as many clients as labels
    alpha: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} is unknown; choose one of {SCHEMES}.")
        if self.num_partitions is not None and self.num_partitions < 1:
            raise ValueError(f"num_partitions={self.num_partitions} must be at least 1.")
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha} must be positive.")


def partition_documents(docs: list[Document], spec: PartitionSpec) -> dict[str, list[int]]:
    """Client id -> indices into `docs`; every document lands in exactly one client."""
    from datasets import Dataset  # imported here: a ClientApp reading shards never needs it

    dataset = Dataset.from_dict({"index": list(range(len(docs))), "label": [d.label for d in docs]})
    labels = sorted({d.label for d in docs})
    count = spec.num_partitions or len(labels)
    if count > len(docs):
        raise ValueError(
            f"num_partitions={count} exceeds the {len(docs)} documents; use fewer partitions. "
            "For a larger population keep num-partitions small and start more nodes: devices "
            "beyond the partitions train on shards of them (fedge.data.shards)."
        )
    if spec.scheme == "iid":
        dataset = dataset.shuffle(seed=spec.seed)  # IidPartitioner shards in dataset order
    partitioner = _partitioner(spec, count)
    partitioner.dataset = dataset
    clients: dict[str, list[int]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Dirichlet retries are reported below
        try:
            total = partitioner.num_partitions
        except ValueError as err:
            raise ValueError(
                f"Dirichlet(alpha={spec.alpha}) left a client empty in every draw for "
                f"num_partitions={count}; use fewer partitions or a larger alpha ({err})."
            ) from err
    for pid in range(total):
        part = partitioner.load_partition(pid)
        name = part["label"][0] if spec.scheme == "natural" else f"client-{pid:03d}"
        clients[name] = sorted(part["index"])
    return clients


def _partitioner(spec: PartitionSpec, count: int) -> Partitioner:
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner

    if spec.scheme == "natural":
        return NaturalIdPartitioner(partition_by="label")
    if spec.scheme == "iid":
        return IidPartitioner(num_partitions=count)
    return DirichletPartitioner(
        num_partitions=count,
        partition_by="label",
        alpha=spec.alpha,
        min_partition_size=1,
        self_balancing=False,
        seed=spec.seed,
    )
