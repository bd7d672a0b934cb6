"""Fixtures of the fleet tests: adapters that fit, collapse acceptance or do not fit; one Serve fleet
per fleet test file, put back as started before each test that uses it; the micro target and draft.

The fleet is module-scoped: it stops (and Ray with it) when its file ends, before the worker
runs another file. Package scope kept it alive to the worker's last test, where a Flower Ray
simulation run in between had already shut its Ray down (its teardown then failed).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from fedge.edge.verifier.limits import RateLimitConfig
from fedge.models import load_causal_lm
from fedge.simulations.local_services import redis_server
from fedge.zoo import ZooPaths
from tests.fleet.harness import settled, wait_for

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(model: Any, out: Path, scale: float, seed: int = 0) -> Path:
    """Wrap `model` in a rank-4 LoRA on every projection with lora_B ~ N(0, scale^2); save it."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="package")
def good_adapter(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter that barely moves the micro target (a federated round's small update)."""
    from fedge.models import load_causal_lm

    return save_adapter(
        load_causal_lm(micro_zoo.target_dir), tmp_path_factory.mktemp("good"), scale=1e-4
    )


@pytest.fixture(scope="package")
def bad_adapter(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random LoRA weights large enough to wreck the target: acceptance collapses."""
    from fedge.models import load_causal_lm

    return save_adapter(
        load_causal_lm(micro_zoo.target_dir), tmp_path_factory.mktemp("bad"), scale=20.0, seed=1
    )


@pytest.fixture(scope="package")
def misfit_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A well-formed adapter of another (narrower) base model."""
    torch.manual_seed(0)
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    return save_adapter(other, tmp_path_factory.mktemp("misfit"), scale=0.1)


@pytest.fixture(scope="module")
def fleet(micro_zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Serve fleet of two micro-target replicas on 127.0.0.1 for every fleet test, its ingress
    keeping its state in a real Redis (on a fixed port, so a rebuilt ingress binds it again);
    Ray and Redis stop after."""
    import ray

    from fedge.edge.fleet.app import FleetConfig, start_fleet
    from fedge.edge.verifier.engine import EngineConfig
    from fedge.ports import free_port

    with redis_server(tmp_path_factory.mktemp("fleet-redis")) as redis:
        config = FleetConfig(
            micro_zoo.target_dir,
            replicas=2,
            port=free_port("127.0.0.1"),
            redis_url=redis.url,
            redis_password_file=redis.password_file,
            replica_cpus=0.0,  # the tests' two cores are shared; Ray must not wait for free CPUs
            health_period_s=1.0,
            # a probe slowed by the suite's other workers must not get a live replica replaced
            # (its sessions would reopen); a drained or dead replica fails its probe at once
            health_timeout_s=30.0,
            engine=EngineConfig(max_draft=8),
        )
        running = start_fleet(config)
        running.started_with = config  # type: ignore[attr-defined]  # what a test may restore
        yield running
        running.stop()
        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture
def as_started(fleet: Any) -> None:
    """Each fleet test gets the fleet as it started, whichever tests ran before it (or none).

    Two replicas of the base model, no canary, no rate limits: a test that promoted an
    adapter or turned autoscaling on leaves a fleet this puts back (in file order, the
    tests that change the fleet come last, so nothing is redeployed). The fleet test files
    name it in `pytestmark`; the fleet-less files of this package never start a fleet.
    """
    from ray import serve

    from fedge.edge.fleet.app import replica_application

    fleet.ingress.set_rate_limits.remote(RateLimitConfig()).result()
    described = fleet.describe()
    if described["canary"] is not None:
        fleet.ingress.set_canary.remote(None).result()
        serve.delete(described["canary"])
    baseline = fleet.started_with
    current = fleet.stored_config()
    shape = ("adapter_dir", "replicas", "min_replicas", "max_replicas")
    if any(getattr(current, k) != getattr(baseline, k) for k in shape):
        stable = described["stable"]
        serve.run(replica_application(baseline), name=stable, route_prefix=None)
        fleet.promote(stable, baseline)
        fleet.config = replace(baseline, fleet_key_file=fleet.config.fleet_key_file)
    wait_for(lambda: settled(fleet), 180, "the fleet's two replicas, none starting or stopping")


@pytest.fixture(scope="package")
def models(micro_zoo: ZooPaths) -> tuple[PreTrainedModel, PreTrainedModel]:
    return load_causal_lm(micro_zoo.target_dir), load_causal_lm(micro_zoo.draft_dir)


@pytest.fixture(scope="package")
def prompts(micro_zoo: ZooPaths) -> list[list[int]]:
    from fedge.edge.prompts import heldout_prompts
    from fedge.models import load_tokenizer

    base = heldout_prompts(load_tokenizer(micro_zoo.target_dir), 8, 40)
    return [p[: 4 + 5 * i] for i, p in enumerate(base)]
