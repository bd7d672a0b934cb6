"""``fedge.clients.privacy.private.make_private``: DP-SGD for a user's own torch loop, with real
Opacus on a small MLP (16 -> 32 -> 4, 256 examples, batches of 32: sample rate 1/8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict
from opacus.accountants import RDPAccountant

from fedge.clients.privacy.ledger import STATE_DIR_ENV, Ledger
from fedge.clients.privacy.private import BudgetExhausted, make_private

N, BATCH = 256, 32
# Opacus' hook on the first layer fires on outputs only (its input needs no gradient)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def mlp() -> torch.nn.Module:
    """The small MLP."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    """256 random examples in batches of 32."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(N, 16, generator=g), torch.randint(0, 4, (N,), generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def one_round(net: torch.nn.Module, **kwargs: object) -> tuple[float, int]:
    """One pass of the user's loop on the private stand-ins; (epsilon, steps taken)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    steps = 0
    with make_private(
        net, optimizer, loader(), noise_multiplier=1.1, max_grad_norm=1.0, **kwargs
    ) as dp:
        for x, y in dp.data_loader:
            dp.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(dp.model(x), y).backward()
            dp.optimizer.step()
            steps += 1
    return dp.epsilon, steps


def opacus_epsilon(rounds: list[int]) -> float:
    """Opacus' own RDP accountant over the same steps at rate 1/8, delta 1e-5."""
    accountant = RDPAccountant()
    accountant.history = [(1.1, BATCH / N, s) for s in rounds]
    return float(accountant.get_epsilon(1e-5))


def test_epsilon_is_opacus_rdp_over_every_round_and_the_model_is_left_clean() -> None:
    """Two rounds on one history: the second epsilon is Opacus' RDP over both rounds' steps, the
    first over the first's; the weights moved; Opacus' hooks are gone after the block."""
    # Prepare
    net, history = mlp(), {}
    before = [p.detach().clone() for p in net.parameters()]
    # Execute
    eps1, steps1 = one_round(net, history=history)
    eps2, steps2 = one_round(net, history=history)
    # Assert
    assert eps1 == pytest.approx(opacus_epsilon([steps1]), rel=1e-9)
    assert eps2 == pytest.approx(opacus_epsilon([steps1, steps2]), rel=1e-9)
    assert eps2 > eps1 > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert all(not m._forward_hooks and not m._backward_hooks for m in net.modules())
    assert all(not hasattr(p, "grad_sample") or p.grad_sample is None for p in net.parameters())


def test_the_ledger_keeps_a_nodes_epsilon_across_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``context`` the history is this node's ledger file (partition 3): a second round in a
    fresh Context of the same partition continues the epsilon instead of restarting at 0."""
    # Prepare
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))

    def context() -> Context:
        return Context(1, 7, {"partition-id": 3}, RecordDict(), {})

    # Execute
    _, steps1 = one_round(mlp(), context=context())
    eps2, steps2 = one_round(mlp(), context=context())
    # Assert
    assert eps2 == pytest.approx(opacus_epsilon([steps1, steps2]), rel=1e-9)
    ledger = Ledger(tmp_path / "partition-00003.json").load()["dp-sgd"]
    assert sum(ledger["steps"]) == steps1 + steps2  # Opacus merges equal (z, q) entries


def test_a_round_that_would_pass_max_epsilon_is_refused_before_a_step() -> None:
    """max_epsilon below one pass's epsilon: refused at make_private, the model untouched."""
    # Prepare
    net = mlp()
    before = [p.detach().clone() for p in net.parameters()]
    # Execute
    with pytest.raises(BudgetExhausted, match="privacy budget exhausted"):
        one_round(net, history={}, max_epsilon=opacus_epsilon([N // BATCH]) * 0.9)
    # Assert
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert all(not m._forward_hooks for m in net.modules())


def test_a_step_beyond_the_admitted_ones_never_reaches_the_model() -> None:
    """Admitted for 2 steps under max_epsilon; the third step is refused after Opacus' noise but
    before the optimizer moves the weights or the accountant counts it."""
    # Prepare
    net, history = mlp(), {}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    dp = make_private(
        net,
        optimizer,
        loader(),
        noise_multiplier=1.1,
        max_grad_norm=1.0,
        history=history,
        max_epsilon=100.0,
        steps=2,
    )
    batches = iter(dp.data_loader)
    # Execute
    for _ in range(2):
        x, y = next(batches)
        dp.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(dp.model(x), y).backward()
        dp.optimizer.step()
    after_two = [p.detach().clone() for p in net.parameters()]
    x, y = next(batches)
    dp.optimizer.zero_grad()
    torch.nn.functional.cross_entropy(dp.model(x), y).backward()
    with pytest.raises(BudgetExhausted, match="admitted for 2"):
        dp.optimizer.step()
    epsilon = dp.close()
    # Assert
    assert all(torch.equal(a, b) for a, b in zip(after_two, net.parameters(), strict=True))
    assert history["steps"] == [2]
    assert epsilon == pytest.approx(opacus_epsilon([2]), rel=1e-9)


def test_opacus_adds_no_log_handler_to_the_clientapps_process() -> None:
    """Opacus calls ``logging.basicConfig`` on import, which printed every line of Flower's log
    twice in a ClientApp process that used DP-SGD (seen in examples/flower-dp before the fix);
    a fresh process that runs a private round keeps the root logger without handlers."""
    # Prepare
    code = (
        "import logging, torch\n"
        "from fedge.clients.privacy.private import make_private\n"
        "net = torch.nn.Linear(4, 2)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=4)\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "with make_private(net, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0):\n"
        "    pass\n"
        "print(len(logging.getLogger().handlers))\n"
    )
    # Execute
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    # Assert
    assert out.stdout.strip() == "0", out.stderr[-2000:]
