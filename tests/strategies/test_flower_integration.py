"""fedge on Flower's and Ray's terms: a Ray cluster's address, shared client state, the FAB's
production ClientApp, and the one private Flower field, guarded."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
from flwr.app import Message, RecordDict

from fedge.server.app import refuse_device_simulation
from fedge.simulations import flower_internals
from fedge.simulations.runner import backend_config, client_state_dir, load_scenario

REPO = Path(__file__).resolve().parents[2]


def test_ray_address_joins_the_cluster_without_resource_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray refuses num_cpus/num_gpus for a cluster it did not start: with RAY_ADDRESS only the
    address goes to ray.init; without it the local Ray gets this machine's CPUs."""
    scenario = load_scenario("quick")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    joined = backend_config(scenario)
    assert joined["init_args"] == {"address": "127.0.0.1:6379"}
    assert joined["client_resources"]["num_cpus"] == scenario.client_cpus
    monkeypatch.delenv("RAY_ADDRESS")
    assert "num_cpus" in backend_config(scenario)["init_args"]


def test_client_state_goes_to_the_configured_shared_directory(tmp_path: Path) -> None:
    """client-state-dir from the scenario wins (a mount every node shares); else the run dir."""
    shared = load_scenario("quick", overrides={"client-state-dir": "/mnt/shared/fedge-state"})
    assert client_state_dir(shared, tmp_path) == "/mnt/shared/fedge-state"
    assert client_state_dir(load_scenario("quick"), tmp_path) == str(tmp_path / "client-state")


def test_the_fab_deploys_the_production_client_app_and_refuses_device_keys() -> None:
    """pyproject's clientapp is fedge.clients.app:app; under `flwr run` device simulation keys are
    refused naming them (they would be ignored by the production ClientApp)."""
    components = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert components["components"]["clientapp"] == "fedge.clients.app:app"
    refuse_device_simulation(components["config"])  # the defaults pass
    with pytest.raises(ValueError, match="straggler-fraction"):
        refuse_device_simulation({**components["config"], "straggler-fraction": 0.5})


def test_the_private_message_id_field_is_where_flower_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """set_message_id writes Flower's private field and reads it back through the public
    property; were Flower to move the field, the write would not show and it raises."""
    reply = Message(RecordDict(), reply_to=_instruction())
    flower_internals.set_message_id(reply, "abc")
    assert reply.metadata.message_id == "abc"
    monkeypatch.setattr(flower_internals, "MESSAGE_ID_FIELD", "_renamed_in_a_future_flower")
    with pytest.raises(flower_internals.FlowerInternalsChanged, match="flower_internals"):
        flower_internals.set_message_id(reply, "def")


def _instruction() -> Message:
    """An instruction message built as a SuperLink-less Grid would (TaskIdentity set)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    return Message(RecordDict(), dst_node_id=2, message_type="train")


def test_the_deprecated_run_simulation_is_there_with_the_arguments_fedge_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fedge's Ray simulations call flwr.simulation.run_simulation (deprecated in Flower 1.42,
    no supported replacement takes app objects) only through flower_internals, which checks it
    takes server_app, client_app, num_supernodes and backend_config; were Flower to remove it
    or change those, this fails naming the module."""
    import flwr.simulation

    assert flower_internals.deprecated_run_simulation() is flwr.simulation.run_simulation
    monkeypatch.delattr(flwr.simulation, "run_simulation")
    with pytest.raises(flower_internals.FlowerInternalsChanged, match="flower_internals"):
        flower_internals.deprecated_run_simulation()
    monkeypatch.setattr(
        flwr.simulation,
        "run_simulation",
        lambda server_app, client_app, num_supernodes: None,
        raising=False,
    )
    with pytest.raises(flower_internals.FlowerInternalsChanged, match="backend_config"):
        flower_internals.deprecated_run_simulation()
