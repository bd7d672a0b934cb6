"""Unit tests of the strategies' math and client hooks, expectations derived by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fedge import keys
from fedge.clients.state import ContextStore, DiskStore, MemoryStore
from fedge.strategies.base import (
    ClientResult,
    GlobalState,
    UniformWeighting,
    build_contribution,
    sum_contributions,
)
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.fedprox import FedProx, proximal_term
from fedge.strategies.registry import build_strategy
from fedge.strategies.scaffold import Scaffold


def _contribute(strategy, deltas, examples, completed=None):  # type: ignore[no-untyped-def]
    completed = completed or [1.0] * len(deltas)
    return [
        build_contribution(
            ClientResult({"w": d}, n, c), strategy.weighting, strategy.accepts_partial_work
        )
        for d, n, c in zip(deltas, examples, completed, strict=True)
    ]


def test_fedavg_equals_weighted_mean_exactly() -> None:
    """Weights 1, 2, 5 (sum 8) and deltas on a 1/8 grid: the mean is exact in float32.

    x = [1, -1]; mean delta = (1*[2,0] + 2*[-1,4] + 5*[0.5,-0.25]) / 8 = [2.5, 6.75] / 8.
    """
    # Prepare
    deltas = [np.array(v, np.float32) for v in ([2, 0], [-1, 4], [0.5, -0.25])]
    state = GlobalState({"w": np.array([1.0, -1.0], np.float32)})
    strategy = FedAvg()
    # Execute
    summed = sum_contributions(_contribute(strategy, deltas, [1, 2, 5]))
    new = strategy.finalize(state, summed, population=3)
    # Assert
    expected = np.array([1.0 + 2.5 / 8, -1.0 + 6.75 / 8], np.float32)
    np.testing.assert_array_equal(new.adapter["w"], expected)
    assert new.server_round == 1
    np.testing.assert_array_equal(summed[keys.KEY_COUNT], [3.0])


def test_fedavg_drops_a_straggler_and_fedprox_keeps_it() -> None:
    """A client with completed=0.5 counts 0 under FedAvg and its full weight under FedProx."""
    deltas = [np.array([1.0], np.float32), np.array([3.0], np.float32)]
    state = GlobalState({"w": np.zeros(1, np.float32)})
    avg = FedAvg().finalize(
        state, sum_contributions(_contribute(FedAvg(), deltas, [1, 1], [1.0, 0.5])), 2
    )
    prox = FedProx(0.0)
    prox_new = prox.finalize(
        state, sum_contributions(_contribute(prox, deltas, [1, 1], [1.0, 0.5])), 2
    )
    np.testing.assert_array_equal(avg.adapter["w"], [1.0])
    np.testing.assert_array_equal(prox_new.adapter["w"], [2.0])


def test_uniform_weighting_wrapper_gives_every_client_weight_one() -> None:
    """Wrapped FedAvg with examples 1 and 3: plain mean of deltas 0 and 4 is 2 (weighted would be 3)."""
    wrapped = UniformWeighting(FedAvg())
    assert wrapped.client_config(1)[keys.CFG_WEIGHTING] == "uniform"
    deltas = [np.array([0.0], np.float32), np.array([4.0], np.float32)]
    summed = sum_contributions(_contribute(wrapped, deltas, [1, 3]))
    new = wrapped.finalize(GlobalState({"w": np.zeros(1, np.float32)}), summed, 2)
    np.testing.assert_array_equal(new.adapter["w"], [2.0])


def test_finalize_refuses_a_round_without_weight() -> None:
    """All clients dropped: finalize says nothing was contributed."""
    state = GlobalState({"w": np.zeros(1, np.float32)})
    summed = sum_contributions(_contribute(FedAvg(), [np.ones(1, np.float32)], [5], [0.5]))
    with pytest.raises(ValueError, match="no client contributed"):
        FedAvg().finalize(state, summed, 1)


def _sgd_client(strategy, x, b, steps, lr, store, server_round=1, payload=None):  # type: ignore[no-untyped-def]
    """Minimise 0.5*(w-b)^2 from w=x with the strategy's hook and plain SGD; return the hook's outputs."""
    from fedge.clients.trainer import run_local_steps

    w = torch.nn.Parameter(torch.tensor([x], dtype=torch.float64))
    state = GlobalState(
        {"w": np.array([x], np.float32)}, strategy.init_extras({"w": np.zeros(1, np.float32)})
    )
    payload = payload if payload is not None else strategy.client_payload(state)
    config = {**strategy.client_config(server_round), keys.CFG_SERVER_ROUND: server_round}
    hook = strategy.client_hook(
        config, {"w": torch.tensor([x], dtype=torch.float64)}, payload, store
    )
    run_local_steps(
        {"w": w}, lambda _s: 0.5 * (w - b).pow(2).sum(), steps, torch.optim.SGD([w], lr=lr), hook
    )
    delta = {"w": (w.detach().numpy() - x).astype(np.float32)}
    extras, new_state = hook.finish(delta, steps, lr)
    return delta, extras, new_state


def test_fedprox_with_mu_zero_equals_fedavg() -> None:
    """Same client, same steps: the proximal hook with mu=0 changes nothing."""
    d_avg, _, _ = _sgd_client(FedAvg(), 0.0, 1.0, 5, 0.1, MemoryStore())
    d_prox, _, _ = _sgd_client(FedProx(proximal_mu=0.0), 0.0, 1.0, 5, 0.1, MemoryStore())
    np.testing.assert_array_equal(d_avg["w"], d_prox["w"])


def test_fedprox_term_and_its_effect_by_hand() -> None:
    """mu/2 * ||w - a||^2 with w=[3, 4], a=0, mu=0.5 is 6.25; one SGD step with mu=1 from x=0, b=1, lr=0.1.

    gradient of 0.5(w-1)^2 + 0.5(w-0)^2 at w=0 is -1 + 0 = -1, so w1 = 0.1 (same as without mu at
    the anchor); second step: grad = (0.1-1) + 1*(0.1-0) = -0.8, w2 = 0.1 + 0.08 = 0.18.
    """
    term = proximal_term({"w": torch.tensor([3.0, 4.0])}, {"w": torch.zeros(2)}, 0.5)
    assert float(term) == pytest.approx(6.25)
    delta, _, _ = _sgd_client(FedProx(proximal_mu=1.0), 0.0, 1.0, 2, 0.1, MemoryStore())
    assert float(delta["w"][0]) == pytest.approx(0.18, abs=1e-6)


def test_scaffold_client_update_by_hand() -> None:
    """f(w) = 0.5 (w - 1)^2, x = 0, c = 0.5, c_i = 0.25, lr = 0.1, K = 2.

    step 1: g = -1,     corrected -1 + (0.5 - 0.25) = -0.75,  y1 = 0.075
    step 2: g = -0.925, corrected -0.675,                      y2 = 0.1425
    c_i+ = c_i - c + (x - y)/(K lr) = 0.25 - 0.5 - 0.1425/0.2 = -0.9625; ctrl = c_i+ - c_i = -1.2125
    """
    store = MemoryStore()
    store.save(0, {"w": np.array([0.25], np.float32)})
    payload = {keys.PREFIX_CONTROL + "w": np.array([0.5], np.float32)}
    delta, extras, new_state = _sgd_client(Scaffold(), 0.0, 1.0, 2, 0.1, store, 1, payload)
    assert float(delta["w"][0]) == pytest.approx(0.1425, abs=1e-6)
    assert new_state is not None
    assert float(new_state["w"][0]) == pytest.approx(-0.9625, abs=1e-5)
    assert float(extras[keys.PREFIX_CONTROL + "w"][0]) == pytest.approx(-1.2125, abs=1e-5)


def test_scaffold_server_update_by_hand() -> None:
    """x = 1, c = 0.5, two of N = 4 clients: deltas 0.2 and 0.6 (weights 1, 1), ctrl -1 and 3, eta_g = 2.

    x+ = 1 + 2 * (0.2 + 0.6)/2 = 1.8;  c+ = 0.5 + (|S|/N) * mean(ctrl) = 0.5 + (2/4) * 1 = 1.0
    """
    strategy = Scaffold(server_lr=2.0, weighting="uniform")
    ctrl = keys.PREFIX_CONTROL + "w"
    state = GlobalState({"w": np.array([1.0], np.float32)}, {ctrl: np.array([0.5], np.float32)})
    contributions = [
        build_contribution(
            ClientResult(
                {"w": np.array([d], np.float32)}, 7, 1.0, {ctrl: np.array([c], np.float32)}
            ),
            "uniform",
            False,
        )
        for d, c in ((0.2, -1.0), (0.6, 3.0))
    ]
    assert set(contributions[0]) == set(strategy.contribution_spec(state))
    new = strategy.finalize(state, sum_contributions(contributions), population=4)
    assert float(new.adapter["w"][0]) == pytest.approx(1.8, abs=1e-6)
    assert float(new.extras[ctrl][0]) == pytest.approx(1.0, abs=1e-6)
    assert strategy.client_payload(new)[ctrl][0] == pytest.approx(1.0)


@pytest.mark.parametrize("store_kind", ["memory", "context", "disk"])
def test_scaffold_control_variate_persists_across_rounds(store_kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Round 2 of the same client starts from the c_i that round 1 saved, in every store."""
    store = {
        "memory": MemoryStore(),
        "context": ContextStore(RecordDict()),
        "disk": DiskStore(tmp_path),
    }[store_kind]
    payload = {keys.PREFIX_CONTROL + "w": np.array([0.0], np.float32)}
    _, _, c1 = _sgd_client(Scaffold(), 0.0, 1.0, 2, 0.1, store, 1, payload)
    assert c1 is not None
    store.save(1, c1)
    hook = Scaffold().client_hook({keys.CFG_SERVER_ROUND: 2}, {"w": torch.zeros(1)}, payload, store)
    np.testing.assert_array_equal(hook.c_i["w"], c1["w"])  # type: ignore[attr-defined]
    # A replay of round 1 (after a resume) still sees the state from before round 1.
    replay = Scaffold().client_hook(
        {keys.CFG_SERVER_ROUND: 1}, {"w": torch.zeros(1)}, payload, store
    )
    np.testing.assert_array_equal(replay.c_i["w"], [0.0])  # type: ignore[attr-defined]


def test_registry_builds_each_strategy_and_names_a_bad_one() -> None:
    """The config key picks the class; an unknown name lists the choices."""
    assert isinstance(build_strategy({keys.CFG_STRATEGY: "scaffold"}), Scaffold)
    prox = build_strategy({keys.CFG_STRATEGY: "fedprox", keys.CFG_PROXIMAL_MU: 0.3})
    assert isinstance(prox, FedProx) and prox.proximal_mu == 0.3
    with pytest.raises(ValueError, match="fedavg, fedprox, scaffold"):
        build_strategy({keys.CFG_STRATEGY: "fedsgd"})
