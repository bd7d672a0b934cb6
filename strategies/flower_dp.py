"""Why Flower's own DP wrappers cannot wrap a fedge strategy, and the refusal that says so.

Flower's ``DifferentialPrivacyServerSideFixedClipping`` (and its client-side and adaptive
siblings, ``flwr.serverapp.strategy.dp_*``) read every train reply as the client's WHOLE
model: each ArrayRecord of the reply, zipped array by array against the global arrays,
clipped as ``local - global``, then noised after the inner strategy's ``aggregate_train`` with
std ``z C / m``, the sensitivity of a plain mean. A fedge strategy breaks each step:

* its replies are one ``contribution`` record (``delta/`` = weight x (local - global),
  SCAFFOLD's ``ctrl/``, public ``meta/weight`` and ``meta/count``), which has more arrays than
  the model, so Flower's zip fails (``ValueError: zip() argument 2 is shorter than argument
  1``), and "clip local - global" has no meaning for a delta or a control variate;
* SCAFFOLD's control delta is as sensitive as the update and Flower never clips it;
* fedge's ``aggregate_train`` ends in the server optimizer (FedAdam, FedYogi, momentum,
  ``server_lr``): noise added after that step is not noise on a mean of clipped updates, so
  ``z C / m`` is not its sensitivity;
* under ``SecAggPlus`` the server never holds a reply to clip at all.

So fedge's strategies refuse to run under those wrappers (naming fedge's own, which clip
the contribution, noise its sum before the server step, and account epsilon):
``fedge.server.privacy.strategy.CentralDP`` and
``fedge.server.secagg.strategy.SecAggPlus(..., dp=DistributedDP(...))``.
"""

from __future__ import annotations

import sys

FLOWER_DP_MODULES = "flwr.serverapp.strategy.dp_"  # dp_fixed_clipping, dp_adaptive_clipping


class FlowerDPWrapperRefused(ValueError):
    """A fedge strategy was wrapped in one of Flower's DP strategy wrappers."""


def refuse_flower_dp_wrapper(strategy: object) -> None:
    """Raise :class:`FlowerDPWrapperRefused` when ``strategy``'s caller (the first frame up whose
    ``self`` is another object: a subclass's ``super()`` calls are skipped) is a method of one
    of Flower's DP strategy wrappers. Called first thing in ``configure_train``, before any
    message is built, so nothing is sent."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_locals.get("self") is strategy:
        frame = frame.f_back  # type: ignore[assignment]
    caller = frame.f_locals.get("self") if frame is not None else None
    if caller is None or not type(caller).__module__.startswith(FLOWER_DP_MODULES):
        return
    raise FlowerDPWrapperRefused(
        f"{type(caller).__name__} cannot wrap fedge's {type(strategy).__name__}: Flower's DP "
        "wrappers clip each reply as the client's whole model (local - global, array by "
        "array) and noise the output of aggregate_train with std z C / m, while fedge replies "
        "with one contribution record (weighted delta/, SCAFFOLD's ctrl/, meta/ keys) and "
        "aggregate_train ends in the server optimizer, so the clip would miss the control "
        "delta and the noise would not match the sensitivity (under SecAgg+ no reply is even "
        "visible). Use fedge.server.privacy.strategy.CentralDP(strategy, noise_multiplier=..., "
        "clip=...) for central DP, or fedge.server.secagg.strategy.SecAggPlus(strategy, "
        "dp=DistributedDP(...)) for distributed DP; both clip the contribution, noise its sum "
        "before the server step and report epsilon in the Result (docs/federation.md)"
    )
