"""The canary's inputs: latency of successful calls only, adapters checked numerically before any
replica stops, a verify burst that fits the longest draft. No Ray needed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedge.edge.fleet.adapters import AdapterMismatch, check_adapter
from fedge.edge.fleet.app import FleetConfig
from fedge.edge.fleet.stats import ArmStats, CallOutcome
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.limits import RateLimitConfig

WEIGHTS = "adapter_model.safetensors"


def doctored(good: Path, out: Path, change: Any) -> Path:
    """A copy of the adapter whose tensors `change` rewrites (in place, name -> tensor)."""
    shutil.copytree(good, out)
    state = load_file(str(out / WEIGHTS))
    change(state)
    save_file(state, str(out / WEIGHTS))
    return out


def test_fast_refusals_do_not_dilute_an_arms_latency() -> None:
    """A canary whose verifies take 40 ms, among 200 UNAUTHENTICATED refusals of 0.1 ms, reports a
    p50 of 40 ms, not a fraction of a millisecond.

    On main every call's latency counted: the canary's p50 read 0.1 ms and a slow adapter
    passed the latency gate (checked on main: p50 0.1 ms)."""
    arm = ArmStats()
    for index in range(50):
        arm.record(
            CallOutcome("Verify", "OK", 0.040, drafted=4, accepted=3, session_id=f"s{index % 10}")
        )
    for _ in range(200):
        arm.record(CallOutcome("Verify", "UNAUTHENTICATED", 0.0001, drafted=4, accepted=0))
        arm.record(CallOutcome("OpenSession", "INVALID_ARGUMENT", 0.0001, drafted=0, accepted=0))
    figures = arm.summary()
    assert figures["latency_p50_ms"] == pytest.approx(40.0)
    assert figures["calls"] == 450 and figures["verifies"] == 50


def test_an_adapter_whose_ranks_disagree_with_its_config_is_refused(
    micro_zoo: Any, good_adapter: Path, tmp_path: Path
) -> None:
    """lora_A of rank 8 with lora_B of rank 4 (config r = 4): refused naming the tensor.

    On main the check was structural only (lora_A [*, in], lora_B [out, *]): this adapter passed
    and would have failed in every replica after the rollout had begun (checked on main)."""

    def widen(state: dict[str, torch.Tensor]) -> None:
        key = next(k for k in sorted(state) if ".lora_A." in k)
        state[key] = torch.cat([state[key], state[key]])  # [4, in] -> [8, in]

    adapter = doctored(good_adapter, tmp_path / "ranks", widen)
    with pytest.raises(AdapterMismatch, match=r"lora_A.* has rank 8, but adapter_config.json"):
        check_adapter(micro_zoo.target_dir, adapter)


def test_an_adapter_with_non_finite_values_is_refused(
    micro_zoo: Any, good_adapter: Path, tmp_path: Path
) -> None:
    """One NaN in a lora_B: refused naming the tensor, before any replica stops.

    On main non-finite values passed the check (checked on main)."""

    def poison(state: dict[str, torch.Tensor]) -> None:
        key = next(k for k in sorted(state) if ".lora_B." in k)
        state[key][0, 0] = float("nan")

    adapter = doctored(good_adapter, tmp_path / "nan", poison)
    with pytest.raises(AdapterMismatch, match=r"lora_B.* holds 1 non-finite values"):
        check_adapter(micro_zoo.target_dir, adapter)
    assert check_adapter(micro_zoo.target_dir, good_adapter)["r"] == 4


def test_the_fleet_refuses_a_verify_burst_below_the_longest_draft(micro_zoo: Any) -> None:
    """A burst below max_draft + 1 would refuse every longest verify; the fleet says so at start.

    On main FleetConfig took it (checked on main)."""
    with pytest.raises(ValueError, match="verify_burst=8 is below"):
        FleetConfig(
            micro_zoo.target_dir,
            engine=EngineConfig(max_draft=8),
            rate_limits=RateLimitConfig(verify_rate=10.0, verify_burst=8),
        )
    FleetConfig(
        micro_zoo.target_dir, rate_limits=RateLimitConfig(verify_rate=10.0, verify_burst=17)
    )


def test_restart_with_an_adapter_takes_the_canary_path() -> None:
    """`restart --adapter` is the rollout (canary, compare, promote or roll back); the rolling
    restart itself keeps the weights, so an application never serves two adapters.

    On main `restart --adapter` rolled the new adapter into the stable application replica by
    replica, skipping the canary (its signature took the adapter)."""
    import inspect

    from fedge.edge.fleet.app import restart_version
    from fedge.edge.fleet.cli import restart_command

    assert "adapter_dir" not in inspect.signature(restart_version).parameters
    assert "rollout_command(" in inspect.getsource(restart_command)
