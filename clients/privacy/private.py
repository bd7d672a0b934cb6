"""DP-SGD for a user's own torch loop: Opacus' ``make_private`` with fedge's accounting.

Three lines around any ClientApp's loop (the loop itself is unchanged)::

    fl = TrainRound.start(msg, context, net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    with make_private(net, optimizer, loader, context=context, noise_multiplier=1.0,
                      max_grad_norm=1.0, fl=fl) as dp:
        for x, y in dp.data_loader:
            dp.optimizer.zero_grad()
            criterion(dp.model(x), y).backward()
            dp.optimizer.step()
    return fl.reply(..., metrics={"dp-sgd-epsilon": dp.epsilon})

Sample-level DP-SGD (Abadi et al. 2016, arXiv:1607.00133): Opacus clips every example's
gradient to ``max_grad_norm`` and adds N(0, (noise_multiplier max_grad_norm)^2) to each step's
sum. Batches are Poisson-sampled (what Opacus' RDP accountant assumes), and both the batches
and the noise come from a generator seeded with 64 fresh bits of OS entropy (Opacus' secure
path, four draws per noise value), never from a seed the server could know. The accountant's
history lives in this node's privacy ledger (``context``: one file per partition under the
node's ``privacy-state-dir``), so ``epsilon`` is this client's cumulative epsilon over every
round it trained in, across runs and restarts; without ``context`` it lives in ``history``, a
mapping the caller keeps (a fresh one: this round only). With ``max_epsilon`` the round is
refused before its first step when ``steps`` more would pass it, and a step beyond ``steps``
is refused before it changes the model (:class:`BudgetExhausted`). Under a fedge strategy,
pass ``fl`` (the round's :class:`TrainRound`): FedProx's proximal gradient and SCAFFOLD's
correction are then added after Opacus' noise (they do not depend on the data, so they cost
no privacy), instead of in the loss where Opacus' per-example clipping would drop them.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Context

from fedge.clients.privacy.dpsgd import (
    DPSGDConfig,
    _add_hook_after_noise,
    load_accountant,
    save_accountant,
    secure_generator,
)
from fedge.clients.privacy.ledger import DPSGD, Ledger, node_ledger
from fedge.clients.privacy.local import BudgetExhausted
from fedge.extras import require
from fedge.privacy.wire import REFUSAL_BUDGET
from fedge.strategies.client import TrainRound

if TYPE_CHECKING:
    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.optimizers import DPOptimizer

__all__ = ["BudgetExhausted", "PrivateTraining", "make_private"]
log = logging.getLogger(__name__)


@dataclass
class PrivateTraining:
    """The private stand-ins for one round: use ``model``, ``optimizer`` and ``data_loader``
    in place of the originals, then :meth:`close` (or leave the ``with`` block)."""

    model: GradSampleModule
    optimizer: DPOptimizer
    data_loader: torch.utils.data.DataLoader  # type: ignore[type-arg]
    dp: DPSGDConfig
    accountant: RDPAccountant
    history: MutableMapping[str, Any]
    ledger: Ledger | None = None
    steps_allowed: int | None = None  # with max_epsilon: the steps this round may take
    steps_taken: int = 0
    closed: bool = field(default=False)

    @property
    def epsilon(self) -> float:
        """This client's cumulative epsilon at ``dp.target_delta`` (earlier rounds included)."""
        history = self.accountant.history
        return float(self.accountant.get_epsilon(self.dp.target_delta)) if history else 0.0

    def close(self) -> float:
        """Remove Opacus' hooks from the model, save the accountant history; return epsilon."""
        if not self.closed:
            self.closed = True
            save_accountant(self.accountant, self.history)
            if self.ledger is not None:
                self.ledger.save({**self.ledger.load(), DPSGD: dict(self.history)})
            self.model._close()  # type: ignore[operator]
        return self.epsilon

    def __enter__(self) -> PrivateTraining:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: torch.utils.data.DataLoader,  # type: ignore[type-arg]
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    target_delta: float = 1e-5,
    context: Context | None = None,
    history: MutableMapping[str, Any] | None = None,
    fl: TrainRound | None = None,
    max_epsilon: float = 0.0,
    steps: int | None = None,
) -> PrivateTraining:
    """Make ``model``, ``optimizer`` and ``data_loader`` private for one round (see the module).

    ``steps`` (default: one pass, ``len(data_loader)`` batches) is what the budget check
    counts when ``max_epsilon`` > 0.
    """
    dp = DPSGDConfig(noise_multiplier, max_grad_norm, target_delta, ffa_lora=False, metric_clip=0.0)
    if max_epsilon < 0:
        raise ValueError(f"max_epsilon={max_epsilon}: must be >= 0 (0: no cap)")
    ledger = node_ledger(context) if context is not None else None
    state: MutableMapping[str, Any] = (
        dict(ledger.load().get(DPSGD, {}))
        if ledger is not None
        else (history if history is not None else {})
    )
    PrivacyEngine = _privacy_engine()  # first: every opacus import installs the handler
    accountant = load_accountant(state)  # before any hook: a corrupt history refuses the round

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns that secure_mode is off at construction
        engine = PrivacyEngine(accountant="rdp")
        engine.secure_mode = True  # Poisson batches and noise from one OS-seeded generator
        engine.secure_rng = secure_generator()
        engine.accountant = accountant
        private, dp_optimizer, dp_loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            poisson_sampling=True,
        )
    out = PrivateTraining(private, dp_optimizer, dp_loader, dp, accountant, state, ledger)
    if max_epsilon > 0:
        out.steps_allowed = len(dp_loader) if steps is None else int(steps)
        trial = load_accountant(state)
        trial.history.append((noise_multiplier, 1.0 / len(dp_loader), out.steps_allowed))
        projected = float(trial.get_epsilon(target_delta))
        if projected > max_epsilon:
            private._close()  # type: ignore[operator]
            log.warning(  # the figures stay in this node's log: epsilon reveals its data size
                "DP-SGD budget: %s more steps would take epsilon from %.3f to %.3f, above %s",
                out.steps_allowed,
                out.epsilon,
                projected,
                max_epsilon,
            )
            raise BudgetExhausted(
                f"{REFUSAL_BUDGET}: more DP-SGD steps would take this client's epsilon above "
                "max_epsilon; no step is taken"
            )
    if fl is not None:
        _add_hook_after_noise(dp_optimizer, fl.hook, fl.trainable)
    _cap_steps(out)
    return out


def _privacy_engine() -> type:
    """Opacus' PrivacyEngine, imported without the root log handler Opacus installs on import
    (``logging.basicConfig`` in ``opacus.utils.module_utils``), which would print every line
    of Flower's log a second time in the ClientApp's process."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    require("opacus", "dp", "make_private (DP-SGD)")  # on the core install: names the extra
    from opacus import PrivacyEngine

    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    return PrivacyEngine


def _cap_steps(run: PrivateTraining) -> None:
    """Refuse a step past ``steps_allowed`` after Opacus' noise but before the model changes
    and before the accountant counts it (the step hook runs between the two)."""
    inner = run.optimizer.step_hook

    def capped(opt: torch.optim.Optimizer) -> None:
        if run.steps_allowed is not None and run.steps_taken >= run.steps_allowed:
            raise BudgetExhausted(
                f"{REFUSAL_BUDGET}: this round was admitted for {run.steps_allowed} DP-SGD "
                "steps under max_epsilon; a further step is refused (pass steps=...)"
            )
        run.steps_taken += 1
        if inner is not None:
            inner(opt)

    run.optimizer.step_hook = capped  # type: ignore[assignment]
