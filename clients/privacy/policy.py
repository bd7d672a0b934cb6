"""The privacy policy a client holds for itself, and the check every train message must pass.

The server chooses which mods run and which threshold and noise a client uses; a
curious server could omit SecAgg+ or send a noise level of zero. So each node holds
its own policy (a TOML file named by the node config key ``privacy-policy``, or by
``FEDGE_PRIVACY_POLICY`` where the engine sets no node config, as in simulation) and
refuses, with an error reply naming the rule, any train message that breaks it::

    require-secagg = true   # every train message must be a SecAgg+ stage
    require-dp = true       # DP-SGD or distributed DP, with
    min-noise = 1.0         #   noise multiplier z >= this
    max-clip = 0.1          #   clip norm C <= this
    max-epsilon = 8.0       # stop contributing before this node's epsilon passes it (0: none)

A SecAgg+ threshold of at most half the neighbourhood is refused with or without a
policy (``clients.secagg.engine``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import tomllib
from flwr.app import ConfigRecord, Context, Message, RecordDict

from clients.privacy.ledger import node_ledger
from fedge import keys
from fedge.errors import FedgeError
from fedge.privacy.accounting import gaussian_epsilon
from fedge.privacy.wire import (
    KEY_DP_CLIP,
    KEY_DP_MIN_CLIENTS,
    KEY_DP_NOISE_STD,
    KEY_DPSGD_CLIP,
    KEY_DPSGD_NOISE,
    REFUSAL_BUDGET,
)
from fedge.secagg.wire import KEY_STAGE, SECAGG_RECORD, STAGE_UNMASK

NODE_POLICY_KEY = "privacy-policy"  # node config: path of the policy file
POLICY_ENV = "FEDGE_PRIVACY_POLICY"  # the same, for engines without node config
ERROR_POLICY = 642  # error code of a refused train message (Flower reserves the small codes)


class PolicyRefusal(FedgeError):
    """A message asks for less privacy than this node's policy allows; it is refused."""


@dataclass(frozen=True)
class PrivacyPolicy:
    """What this node requires before it trains on its data and sends anything back."""

    require_secagg: bool = False
    require_dp: bool = False
    min_noise: float = 0.0  # z: least noise multiplier accepted under require-dp
    max_clip: float = math.inf  # C: largest clip norm accepted under require-dp
    max_epsilon: float = 0.0  # 0: no cap of this node's own epsilon
    delta: float = 1e-5  # delta of max-epsilon

    def __post_init__(self) -> None:
        """Reject a policy that cannot be enforced, naming the field."""
        if not (self.min_noise >= 0 and math.isfinite(self.min_noise)):
            raise ValueError(f"privacy policy min-noise={self.min_noise}: must be >= 0")
        if not self.max_clip > 0:
            raise ValueError(f"privacy policy max-clip={self.max_clip}: must be > 0")
        if self.max_epsilon < 0:
            raise ValueError(f"privacy policy max-epsilon={self.max_epsilon}: must be >= 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy policy delta={self.delta}: must be in (0, 1)")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object], source: str) -> PrivacyPolicy:
        """Build from hyphenated keys; an unknown key is an error naming ``source``."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(
                f"{source}: unknown privacy policy key(s) {unknown}; known: {sorted(known)}"
            )
        values = {}
        for key, value in raw.items():
            kind = type(getattr(cls(), known[key].name))
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
            values[known[key].name] = kind(value)  # type: ignore[call-arg]
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> PrivacyPolicy:
        """Read a policy file; a missing or malformed file is an error, never an empty policy."""
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"privacy policy {path}: cannot read it ({exc})") from exc
        return cls.from_mapping(raw, str(path))


def node_policy(node_config: Mapping[str, object]) -> PrivacyPolicy:
    """This node's policy: the file named by its node config, else by the environment, else none."""
    path = str(node_config.get(NODE_POLICY_KEY, "") or os.environ.get(POLICY_ENV, ""))
    return PrivacyPolicy.load(Path(path)) if path else PrivacyPolicy()


@dataclass(frozen=True)
class DPRequest:
    """The DP a train message asks this client to apply: mechanism, noise multiplier, clip."""

    mechanism: str  # "DP-SGD" or "distributed DP"
    noise_multiplier: float
    clip: float


def requested_dp(config: Mapping[str, object]) -> DPRequest | None:
    """What DP the message's config asks this client to apply (None: none on this node).

    Distributed DP's multiplier is the one of the released sum, std sqrt(m) / C, with
    m the contributors the server says a round needs (1 when it says nothing, the
    conservative reading: then this client's own noise must carry the whole z).
    """
    z_sgd = float(str(config.get(KEY_DPSGD_NOISE, 0.0)))
    if z_sgd > 0:
        return DPRequest("DP-SGD", z_sgd, float(str(config.get(KEY_DPSGD_CLIP, 1.0))))
    if KEY_DP_NOISE_STD in config and KEY_DP_CLIP in config:
        clip = float(str(config[KEY_DP_CLIP]))
        std = float(str(config[KEY_DP_NOISE_STD]))
        m = max(1, int(float(str(config.get(KEY_DP_MIN_CLIENTS, 1)))))
        return DPRequest("distributed DP", std * math.sqrt(m) / clip, clip)
    return None


def check_train(policy: PrivacyPolicy, msg: Message, context: Context) -> None:
    """Raise :class:`PolicyRefusal` naming the rule a train message breaks; return if none."""
    content = msg.content if msg.has_content() else RecordDict()
    config = content.config_records.get(keys.REC_CONFIG, ConfigRecord())
    secagg = content.config_records.get(SECAGG_RECORD)
    if policy.require_secagg and secagg is None:
        raise PolicyRefusal(
            "this node requires SecAgg+ (require-secagg) and the train message is not a SecAgg+ "
            "stage; run the server with a SecAgg+ aggregator"
        )
    dp = requested_dp(config)
    if policy.require_dp:
        if dp is None:
            raise PolicyRefusal(
                "this node requires differential privacy applied on the node (DP-SGD or "
                "distributed DP, require-dp) and the train message asks for none"
            )
        if dp.mechanism == "distributed DP" and secagg is None:
            raise PolicyRefusal(
                "distributed DP without SecAgg+ would show the server this node's update"
            )
        if dp.noise_multiplier < policy.min_noise:
            raise PolicyRefusal(
                f"{dp.mechanism} noise multiplier {dp.noise_multiplier:.4g} is below this node's "
                f"min-noise {policy.min_noise}"
            )
        if dp.clip > policy.max_clip:
            raise PolicyRefusal(
                f"{dp.mechanism} clip norm {dp.clip:.4g} is above this node's max-clip {policy.max_clip}"
            )
    unmask = secagg is not None and secagg.get(KEY_STAGE) == STAGE_UNMASK
    if (
        policy.max_epsilon > 0
        and dp is not None
        and dp.mechanism == "distributed DP"
        and not unmask
    ):
        ledger = node_ledger(context)
        projected = gaussian_epsilon([*ledger.releases(), dp.noise_multiplier], policy.delta, "rdp")
        if projected > policy.max_epsilon:
            raise PolicyRefusal(
                f"{REFUSAL_BUDGET}: one more distributed-DP round would bring this node's "
                f"epsilon to {projected:.3f}, above its max-epsilon {policy.max_epsilon}"
            )


def dpsgd_budget(policy: PrivacyPolicy, config: Mapping[str, object]) -> float:
    """The epsilon a DP-SGD client may reach: the smaller of its own and the run's (0: none)."""
    caps = [
        c for c in (policy.max_epsilon, float(str(config.get(keys.CFG_MAX_EPSILON, 0.0)))) if c > 0
    ]
    return min(caps) if caps else 0.0
