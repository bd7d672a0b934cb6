"""Session fixtures shared by every test area: the micro zoo and a natural-partition corpus."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.process_state import process_state_restored

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("FEDGE_HOME", str(REPO / ".fedge-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see the Makefile

MICRO_CHARS_PER_CLIENT = 20_000  # the micro zoo's own corpus size per package

# `make test` hands whole files to its workers in collection order (xdist --dist loadfile,
# --no-loadscope-reorder): the files that take minutes go first, longest first, so the
# workers do not end on them one after another while the short files wait behind.
LONG_FILES = (
    "server/test_flower_engines.py",
    "fleet/test_fleet_rollout.py",
    "fleet/test_fleet.py",
    "simulations/test_simulate.py",
    "fedge/test_zoo.py",
    "edge/test_recovery.py",
    "privacy/test_matrix.py",
    "simulations/test_devices_federation.py",
    "simulations/test_realign.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the long files first (scheduling only: a stable sort, tests keep their order)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}

    def first(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(REPO / "tests").as_posix(), len(rank))
        except ValueError:
            return len(rank)

    items.sort(key=first)


@pytest.fixture(scope="session")
def micro_zoo():  # type: ignore[no-untyped-def]
    """The micro zoo, built once per cache directory and verified against its manifests."""
    from fedge.zoo import ensure_zoo

    return ensure_zoo("micro")


@pytest.fixture(scope="session")
def micro_corpus(micro_zoo):  # type: ignore[no-untyped-def]
    """The natural (one client per stdlib package) partition, tokenized with the micro tokenizer."""
    from fedge.data import build_federated_corpus

    return build_federated_corpus(
        micro_zoo.target_dir, scheme="natural", max_chars_per_client=MICRO_CHARS_PER_CLIENT
    )


@pytest.fixture(autouse=True)
def _process_state_restored() -> Iterator[None]:
    """No test's outcome may depend on which test ran before it in the same worker
    (`tests.process_state`)."""
    with process_state_restored():
        yield


@pytest.fixture(scope="session")
def redis_instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real redis-server on 127.0.0.1 (password from a file) for the tests that ask for it."""
    from fedge.simulations.local_services import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def fresh_redis(redis_instance: Any) -> Any:
    """The session's Redis, emptied: each test starts from no state (the server, for its URL and
    password file)."""
    import redis

    client = redis.Redis.from_url(redis_instance.url, password=redis_instance.password)
    client.flushall()
    client.close()
    return redis_instance


@pytest.fixture(params=["memory", "redis"])
def ingress_state_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """IngressSpec options placing the fleet's state in the ingress's memory or in a real Redis."""
    if request.param == "memory":
        return {}
    server = request.getfixturevalue("fresh_redis")
    return {"redis_url": server.url, "redis_password_file": server.password_file}
