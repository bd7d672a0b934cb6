"""Sample-level DP-SGD on a client's LoRA parameters with Opacus, accounted across rounds.

One record is one disjoint window of ``seq_len + 1`` tokens of the client's training
stream; Opacus' DPDataLoader draws every batch by Poisson sampling with rate
``batch_size / records``, which is what its RDP accountant assumes, so the amplification
it claims is real, and both the batches and the noise are drawn from a generator seeded
from the OS CSPRNG every round, never from the run's seed (the server knows that seed,
and with it could replay the noise and the batch membership). The accountant's history
is a mapping the caller persists (``fedge.clients.privacy.ledger``, on the node's disk), so
epsilon accumulates over every round the client trains in, across restarts (the
PrivacyEngine object itself is rebuilt around it each round because the model object the
engine hooks is rebuilt per round).

The training loss leaves the node only as a DP release (:func:`loss_release`, issue 30):
each step also sums the batch's per-record losses, each clipped into [0, L], and adds
N(0, (k z L)^2) on the same Poisson batch as the gradient's step. Scaled by C / (k L)
the pair is one Gaussian step of std zC on a vector of sensitivity C sqrt(1 + 1/k^2), so
the round enters the accountant as (z / sqrt(1 + 1/k^2), q, steps) instead of (z, q, steps)
(k = 3 by default: about 10% more epsilon). Before, the un-noised mean loss went out beside
an epsilon that did not count it (a membership oracle: the canary holder's loss was lower
every round).
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedge.extras import require
from fedge.lm.bos import disjoint_windows
from fedge.privacy.randomness import secure_normal
from fedge.privacy.wire import DEFAULT_METRIC_CLIP, DEFAULT_METRIC_NOISE_SCALE
from fedge.strategies.base import ClientHook

if TYPE_CHECKING:  # Opacus loads SciPy (seconds): imported where a DP-SGD round needs it
    from opacus.accountants import RDPAccountant

_NOISE, _RATE, _STEPS = "noise-multipliers", "sample-rates", "steps"  # accountant history
State = MutableMapping[str, Any]  # the persisted accountant history (three parallel lists)


@dataclass(frozen=True)
class DPSGDConfig:
    """DP-SGD knobs (Abadi et al. 2016, arXiv:1607.00133) for one client."""

    noise_multiplier: float = 1.0  # sigma of the per-step Gaussian, in units of max_grad_norm
    max_grad_norm: float = 1.0  # per-sample L2 clip of the LoRA gradient
    target_delta: float = 1e-5  # delta at which epsilon is reported
    ffa_lora: bool = True  # freeze lora_A, train lora_B (Sun et al. 2024, FFA-LoRA)
    # L: per-record loss clip of the noised loss release (0: the loss stays home, no cost)
    metric_clip: float = DEFAULT_METRIC_CLIP
    metric_noise_scale: float = DEFAULT_METRIC_NOISE_SCALE  # k: the loss's noise is k z L

    def __post_init__(self) -> None:
        """Reject settings Opacus or the accountant cannot use, naming the field."""
        if not (self.metric_clip >= 0 and math.isfinite(self.metric_clip)):
            raise ValueError(f"dp-sgd metric_clip={self.metric_clip}: must be >= 0")
        if not (self.metric_noise_scale >= 1 and math.isfinite(self.metric_noise_scale)):
            raise ValueError(f"dp-sgd metric_noise_scale={self.metric_noise_scale}: must be >= 1")
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"dp-sgd noise_multiplier={self.noise_multiplier}: must be > 0")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"dp-sgd max_grad_norm={self.max_grad_norm}: must be > 0")
        if not 0 < self.target_delta < 1:
            raise ValueError(f"dp-sgd target_delta={self.target_delta}: must be in (0, 1)")

    @property
    def accounted_multiplier(self) -> float:
        """The multiplier a round's steps are accounted at: z, or z / sqrt(1 + 1/k^2) when each
        step also releases the batch's noised loss sum (one joint Gaussian, see the module doc)."""
        if self.metric_clip <= 0:
            return self.noise_multiplier
        return self.noise_multiplier / math.sqrt(1.0 + self.metric_noise_scale**-2)


@dataclass(frozen=True)
class DPSGDOutcome:
    """What one round of DP-SGD did: per-step losses (they stay on the node), the noised
    loss it may release (NaN when ``metric_clip`` is 0) and the client's cumulative epsilon."""

    losses: list[float]
    epsilon: float
    sample_rate: float
    records: int
    loss_release: float = math.nan


def freeze_lora_a(model: torch.nn.Module) -> int:
    """FFA-LoRA: stop training every ``lora_A`` tensor; return how many were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        if "lora_A" in name and param.requires_grad:
            param.requires_grad_(False)
            frozen += 1
    return frozen


def token_records(tokens: np.ndarray, seq_len: int, bos: int | None = None) -> torch.Tensor:
    """Cut a token stream into disjoint (records, seq_len + 1) windows: the DP unit (BOS first
    when ``bos`` is given, `fedge.lm.bos`)."""
    n = len(tokens) // (seq_len + 1)
    if n < 1:
        raise ValueError(  # no count: the stream's length is this node's data
            "this client's stream holds no whole DP-SGD record of seq-len + 1 tokens; lower "
            "seq-len or give the client more data"
        )
    rows = disjoint_windows(tokens, seq_len, bos)
    return torch.from_numpy(rows)


def secure_generator() -> torch.Generator:
    """A torch generator seeded with 64 fresh bits from the OS CSPRNG (noise and sampling).

    Opacus' own secure mode needs ``torchcsprng``, which has no build for this torch; a
    seed drawn from the OS every round and recorded nowhere is the substitute: nothing in
    the run's config or files replays the stream.
    """
    return torch.Generator().manual_seed(secrets.randbits(64))


def load_accountant(state: State) -> RDPAccountant:
    """Rebuild the client's RDP accountant from its persisted history."""
    require("opacus", "dp", "DP-SGD")
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    columns = [state.get(key, []) for key in (_NOISE, _RATE, _STEPS)]
    if not all(isinstance(c, list) for c in columns):
        raise ValueError("the DP-SGD accountant history is corrupt; this client refuses to train")
    noises, rates, steps = (np.asarray(c, dtype=np.float64) for c in columns)
    accountant.history = [
        (float(z), float(q), int(s)) for z, q, s in zip(noises, rates, steps, strict=True)
    ]
    return accountant


def save_accountant(accountant: RDPAccountant, state: State) -> None:
    """Write the accountant history into ``state`` (three parallel lists)."""
    state[_NOISE] = [float(z) for z, _, _ in accountant.history]
    state[_RATE] = [float(q) for _, q, _ in accountant.history]
    state[_STEPS] = [int(s) for _, _, s in accountant.history]


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Per-batch mean next-token loss; each row's gradient is one record's gradient."""
    return record_losses(model, batch).mean()


def record_losses(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Each record's mean next-token loss, shape (records,); their mean is the batch loss."""
    logits = model(input_ids=batch[:, :-1]).logits
    per_token = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
    )
    return per_token.reshape(batch.shape[0], -1).mean(dim=1)


@dataclass
class LossSum:
    """The noised per-step sums of clipped record losses (the loss release's numerator)."""

    clip: float  # L
    noise_multiplier: float  # z: each step's sum gets N(0, (zL)^2)
    total: float = 0.0

    def add(self, losses: torch.Tensor | None) -> None:
        """One step: the batch's record losses clipped into [0, L] and summed, plus noise."""
        if self.clip <= 0:
            return
        clipped = 0.0 if losses is None else float(losses.detach().clamp(0, self.clip).sum())
        self.total += clipped + float(secure_normal((1,), self.noise_multiplier * self.clip)[0])


def loss_release(noised_total: float, steps: int, batch_size: int) -> float:
    """The released mean loss: the noised sum over ``steps`` divided by steps x the configured
    batch size (public numbers; the Poisson batches' real sizes and the record count are not)."""
    return noised_total / max(1, steps * batch_size)


def train_dpsgd(
    model: torch.nn.Module,
    tokens: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    dp: DPSGDConfig,
    state: State,
    hook: ClientHook | None = None,
    bos: int | None = None,
) -> DPSGDOutcome:
    """Run ``steps`` DP-SGD steps on the trainable (LoRA) parameters of ``model``.

    The strategy hook's data-independent terms (FedProx's proximal gradient, SCAFFOLD's
    control correction) are added after Opacus clips and noises the data gradient, so they
    cost no privacy. ``state`` carries the accountant across rounds. The model is left
    unwrapped (Opacus' hooks removed) when this returns.
    """
    if dp.ffa_lora:
        freeze_lora_a(model)  # callers that cache the model unfreeze it themselves
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("the model has no trainable parameters; apply LoRA before DP-SGD")
    records = token_records(tokens, seq_len, bos)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(records), batch_size=min(batch_size, len(records))
    )
    optimizer = torch.optim.AdamW(list(named.values()), lr=lr, weight_decay=0.0)
    require("opacus", "dp", "DP-SGD")
    from opacus import PrivacyEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns that secure_mode is off at construction
        engine = PrivacyEngine(accountant="rdp")
        # Opacus' secure path (Poisson batches and noise from one generator, the noise summed
        # from four draws against floating-point attacks) with an OS-seeded generator.
        engine.secure_mode = True
        engine.secure_rng = secure_generator()
        engine.accountant = load_accountant(state)
        before = list(engine.accountant.history)  # the round is re-accounted below
        private, dp_optimizer, dp_loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.max_grad_norm,
            poisson_sampling=True,
        )
    _add_hook_after_noise(dp_optimizer, hook, named)
    losses: list[float] = []
    loss_sum = LossSum(dp.metric_clip, dp.metric_noise_scale * dp.noise_multiplier)
    with warnings.catch_warnings():
        # frozen embeddings: torch notes that the full backward hook fires on outputs only
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        _run_steps(private, dp_optimizer, dp_loader, named, steps, losses, loss_sum)
    rate = 1.0 / len(dp_loader)
    # Opacus' hook counted each step at (z, q); with the loss release a step is one joint
    # Gaussian at z / sqrt(1 + 1/k^2) (module doc), so the round is accounted at that.
    engine.accountant.history = [*before, (dp.accounted_multiplier, rate, len(losses))]
    save_accountant(engine.accountant, state)
    released = (
        loss_release(loss_sum.total, len(losses), batch_size) if dp.metric_clip > 0 else math.nan
    )
    return DPSGDOutcome(
        losses=losses,
        epsilon=float(engine.accountant.get_epsilon(dp.target_delta)),
        sample_rate=rate,
        records=len(records),
        loss_release=released,
    )


def _run_steps(
    private: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: torch.utils.data.DataLoader,
    named: dict[str, torch.nn.Parameter],
    steps: int,
    losses: list[float],
    loss_sum: LossSum,
) -> None:
    """The DP-SGD loop: Poisson batch, per-sample grads, Opacus clip + noise + step (and the
    batch's noised loss sum, ``loss_sum``)."""
    try:
        private.train()
        batches = iter(loader)
        while len(losses) < steps:
            try:
                (batch,) = next(batches)
            except StopIteration:
                batches = iter(loader)
                continue
            optimizer.zero_grad(set_to_none=True)
            if batch.shape[0] == 0:
                _empty_batch_grad_samples(named)
                losses.append(float("nan"))
                loss_sum.add(None)  # an empty batch releases noise only, and is counted
            else:
                per_record = record_losses(private, batch)
                loss = per_record.mean()
                loss.backward()
                losses.append(float(loss.detach()))
                loss_sum.add(per_record)
            optimizer.step()
    finally:
        private._close()  # type: ignore[operator]  # remove Opacus' hooks; the model is reused


def cumulative_epsilon(state: State, delta: float) -> float:
    """Epsilon this client has spent over every round so far (0.0 before its first step)."""
    accountant = load_accountant(state)
    return float(accountant.get_epsilon(delta)) if accountant.history else 0.0


def projected_epsilon(
    state: State, dp: DPSGDConfig, *, records: int, batch_size: int, steps: int
) -> float:
    """Epsilon this client would have spent after ``steps`` more DP-SGD steps (none taken)."""
    accountant = load_accountant(state)
    rate = 1.0 / math.ceil(records / min(batch_size, records))  # Opacus' DPDataLoader rate
    accountant.history.append((dp.accounted_multiplier, rate, steps))
    return float(accountant.get_epsilon(dp.target_delta))


def _empty_batch_grad_samples(named: dict[str, torch.nn.Parameter]) -> None:
    """A Poisson batch can be empty: the step then releases noise only, and is still counted."""
    for p in named.values():
        p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype)  # type: ignore[attr-defined]


def _add_hook_after_noise(
    optimizer: torch.optim.Optimizer, hook: ClientHook | None, named: dict[str, torch.nn.Parameter]
) -> None:
    """Chain the strategy's gradient terms after Opacus' noise (and its accountant hook)."""
    if hook is None:
        return
    accountant_hook = optimizer.step_hook  # type: ignore[attr-defined]

    def after_noise(opt: torch.optim.Optimizer) -> None:
        if accountant_hook is not None:
            accountant_hook(opt)
        reg = hook.regularizer(named)
        if reg is not None:
            grads = torch.autograd.grad(reg, list(named.values()), allow_unused=True)
            for p, g in zip(named.values(), grads, strict=True):
                if g is not None and p.grad is not None:
                    p.grad.add_(g)
        hook.correct_gradients(named)

    optimizer.step_hook = after_noise  # type: ignore[attr-defined]
