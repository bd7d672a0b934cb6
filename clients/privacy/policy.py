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
    max-epsilon = 8.0       # stop contributing before this node's epsilon passes it (0: none);
                            #   implies require-dp, and refuses evaluate messages
    secagg-min-neighbours = 4   # SecAgg+ neighbourhoods smaller than this are refused
    secagg-min-threshold = 3    # SecAgg+ thresholds lower than this are refused
    trusted-keys = "trust.txt"  # neighbours only under these Ed25519 keys (beside this file)
    once-per-model = true       # train at most once on each global model (ledger-backed)

Under require-secagg, require-dp or max-epsilon, evaluate messages are refused (their
replies carry the node's loss in clear), and no train metric leaves the node in clear
(:mod:`fedge.clients.privacy.replies`). Every DP number in a message must be finite and
in range. A refusal names the rule, never a count or value of this node's data, nor the
numbers it compared (a refusal that depends on data is an oracle a server can bisect). A SecAgg+ threshold of at most half the neighbours is refused with or without
a policy (``fedge.clients.secagg.engine``).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import tomllib
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedge import keys
from fedge.clients.privacy.ledger import node_ledger
from fedge.errors import FedgeError
from fedge.privacy.accounting import gaussian_epsilon
from fedge.privacy.mechanism import loss_release_settings
from fedge.privacy.wire import (
    KEY_DP_CLIP,
    KEY_DP_MIN_CLIENTS,
    KEY_DP_NOISE_STD,
    KEY_DPSGD_CLIP,
    KEY_DPSGD_DELTA,
    KEY_DPSGD_NOISE,
    REFUSAL_BUDGET,
)
from fedge.secagg.binding import model_digest
from fedge.secagg.wire import (
    KEY_NEIGHBOURS,
    KEY_STAGE,
    KEY_THRESHOLD,
    SECAGG_RECORD,
    STAGE_COLLECT,
    get_bytes,
    get_number,
    unpack_ids,
)

NODE_POLICY_KEY = "privacy-policy"  # node config: path of the policy file
POLICY_ENV = "FEDGE_PRIVACY_POLICY"  # the same, for engines without node config
ERROR_POLICY = 642  # error code of a refused train message (Flower reserves the small codes)
# min-noise under require-dp or max-epsilon when the policy file does not set it: z = 1.0, one
# release of which costs epsilon ~4.8 at delta 1e-5 (Gaussian, RDP); never 0.
DEFAULT_MIN_NOISE = 1.0


class PolicyRefusal(FedgeError):
    """A message asks for less privacy than this node's policy allows; it is refused."""


@dataclass(frozen=True)
class PrivacyPolicy:
    """What this node requires before it trains on its data and sends anything back."""

    require_secagg: bool = False
    require_dp: bool = False
    min_noise: float = (
        math.nan
    )  # z accepted under require-dp (unset: DEFAULT_MIN_NOISE there, else 0)
    max_clip: float = math.inf  # C: largest clip norm accepted under require-dp
    max_epsilon: float = 0.0  # 0: no cap of this node's own epsilon (> 0 implies require-dp)
    delta: float = 1e-5  # delta of max-epsilon
    secagg_min_neighbours: int = 1  # SecAgg+ neighbourhoods smaller than this are refused
    secagg_min_threshold: int = 1  # SecAgg+ thresholds lower than this are refused
    trusted_keys: str = ""  # trust list file of neighbours' Ed25519 keys ("": any signed key)
    once_per_model: bool = False  # train at most once on each global model (no differencing)

    def __post_init__(self) -> None:
        """Resolve an unset min-noise, reject a policy that cannot be enforced, naming the field."""
        if math.isnan(self.min_noise):  # unset: a floor wherever DP is required
            strict_dp = self.require_dp or self.max_epsilon > 0
            object.__setattr__(self, "min_noise", DEFAULT_MIN_NOISE if strict_dp else 0.0)
        if not (self.min_noise >= 0 and math.isfinite(self.min_noise)):
            raise ValueError(f"privacy policy min-noise={self.min_noise}: must be >= 0")
        if not self.max_clip > 0:
            raise ValueError(f"privacy policy max-clip={self.max_clip}: must be > 0")
        if self.max_epsilon < 0:
            raise ValueError(f"privacy policy max-epsilon={self.max_epsilon}: must be >= 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy policy delta={self.delta}: must be in (0, 1)")
        if not math.isfinite(self.max_epsilon):
            raise ValueError(f"privacy policy max-epsilon={self.max_epsilon}: must be finite")
        if self.secagg_min_neighbours < 1 or self.secagg_min_threshold < 1:
            raise ValueError(
                "privacy policy secagg-min-neighbours and secagg-min-threshold must be >= 1"
            )

    @property
    def strict(self) -> bool:
        """Whether this policy promises anything (SecAgg+ or DP): its replies carry no metric
        and no refusal text that depends on the node's data."""
        return self.require_secagg or self.require_dp or self.max_epsilon > 0

    def promise(self) -> str:
        """What this node promises, as the rule names it holds ("none" for no policy)."""
        rules = [
            name
            for name, held in (
                ("require-secagg", self.require_secagg),
                ("require-dp", self.require_dp or self.max_epsilon > 0),
                ("max-epsilon", self.max_epsilon > 0),
                ("trusted-keys", bool(self.trusted_keys)),
                ("once-per-model", self.once_per_model),
            )
            if held
        ]
        return ",".join(rules) or "none"

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
            kind = type(getattr(cls(), known[key].name))  # min-noise: float (0.0 resolved)
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
            values[known[key].name] = kind(value)  # type: ignore[call-arg]
        return cls(**values)  # type: ignore[arg-type]

    @staticmethod
    def read(path: Path) -> str:
        """The text of a policy file; a missing or unreadable file is an error."""
        try:
            return path.read_text()
        except OSError as exc:
            raise ValueError(f"privacy policy {path}: cannot read it ({exc})") from exc

    @classmethod
    def parse(cls, text: str, path: Path) -> PrivacyPolicy:
        """Build from the TOML ``text`` of the policy file ``path``; a malformed file is an
        error, never an empty policy. A relative ``trusted-keys`` path is read beside the file."""
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"privacy policy {path}: cannot read it ({exc})") from exc
        if isinstance(raw.get("trusted-keys"), str) and raw["trusted-keys"]:
            raw["trusted-keys"] = str(path.parent / Path(raw["trusted-keys"]).expanduser())
        return cls.from_mapping(raw, str(path))


def node_policy(node_config: Mapping[str, object]) -> PrivacyPolicy:
    """This node's policy: the file named by its node config, else by the environment, else none."""
    path = str(node_config.get(NODE_POLICY_KEY, "") or os.environ.get(POLICY_ENV, ""))
    if not path:
        return PrivacyPolicy()
    return _parsed_policy(path, PrivacyPolicy.read(Path(path)))


@functools.lru_cache(maxsize=64)
def _parsed_policy(path: str, text: str) -> PrivacyPolicy:
    """The policy ``text`` read from ``path``, parsed once per distinct content: the file is
    read for every message (an edit applies at once), the TOML parsed only when it changed."""
    return PrivacyPolicy.parse(text, Path(path))


@dataclass(frozen=True)
class DPRequest:
    """The DP a train message asks this client to apply: mechanism, noise multiplier, clip."""

    mechanism: str  # "DP-SGD" or "distributed DP"
    noise_multiplier: float
    clip: float


def requested_dp(
    config: Mapping[str, object], secagg: Mapping[str, object] | None = None
) -> DPRequest | None:
    """What DP the message's config asks this client to apply (None: none on this node).

    Every DP number must be finite and in range, else :class:`PolicyRefusal`. Distributed
    DP's multiplier is this client's worst case, std sqrt(m) / C, with m the contributors
    it can verify itself (:func:`verified_contributors`), never the server's dp-min-clients.
    """
    z_sgd = _number(config, KEY_DPSGD_NOISE, 0.0, low=0.0, closed=True)
    if z_sgd > 0:
        _number(config, KEY_DPSGD_DELTA, 1e-5, low=0.0, high=1.0)
        return DPRequest("DP-SGD", z_sgd, _number(config, KEY_DPSGD_CLIP, 1.0, low=0.0))
    clip = _number(config, KEY_DP_CLIP, 1.0, low=0.0)  # central DP sends C alone
    if KEY_DP_NOISE_STD in config:
        std = _number(config, KEY_DP_NOISE_STD, 0.0, low=0.0, closed=True)
        if KEY_DP_CLIP not in config:
            raise PolicyRefusal(f"config has '{KEY_DP_NOISE_STD}' without '{KEY_DP_CLIP}'")
        _number(config, KEY_DP_MIN_CLIENTS, 1.0, low=1.0, closed=True)  # checked, not trusted
        m = verified_contributors(secagg)
        return DPRequest("distributed DP", std * math.sqrt(m) / clip, clip)
    return None


def _number(
    config: Mapping[str, object],
    key: str,
    default: float,
    *,
    low: float,
    high: float = math.inf,
    closed: bool = False,
) -> float:
    """Config value ``key`` as a finite float above ``low`` (or equal, when ``closed``)."""
    raw = config.get(key, default)
    try:
        value = float(str(raw)) if not isinstance(raw, bool) else math.nan
    except ValueError:
        value = math.nan
    above = value >= low if closed else value > low
    if not (math.isfinite(value) and above and value <= high):
        bound = f"{'>=' if closed else '>'} {low}" + (f" and <= {high}" if high < math.inf else "")
        raise PolicyRefusal(  # the key and its fixed bound: nothing of this node's
            f"config '{key}' must be a finite number {bound} (rule: every number from a message "
            "is finite and in range); this node refuses the message"
        )
    return value


def verified_contributors(secagg: Mapping[str, object] | None) -> int:
    """The fewest inputs any sum that contains this client's unmasked input can hold.

    In a SecAgg+ collect stage with n neighbours and threshold t (n >= t > n/2, which the
    engine enforces) at least 2t - n neighbours' inputs share every sum with this one
    (``fedge.clients.secagg.engine``); without SecAgg+ it is this client alone.
    """
    if secagg is None or secagg.get(KEY_STAGE) != STAGE_COLLECT:
        return 1
    try:
        n = len(unpack_ids(get_bytes(secagg, KEY_NEIGHBOURS)))
        t = get_number(secagg, KEY_THRESHOLD)
    except ValueError:
        return 1
    if not (math.isfinite(t) and t == int(t) and n >= t and 2 * t > n):
        return 1
    return 1 + 2 * int(t) - n


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
    dp = requested_dp(config, secagg)
    if secagg is not None and secagg.get(KEY_STAGE) != STAGE_COLLECT:
        return  # key advertisement or unmasking: nothing is trained or released here
    if policy.require_dp or policy.max_epsilon > 0:
        if dp is None:
            raise PolicyRefusal(
                "this node requires differential privacy applied on the node (DP-SGD or "
                "distributed DP; require-dp, implied by max-epsilon) and the train message asks "
                "for none"
            )
        if dp.mechanism == "distributed DP" and secagg is None:
            raise PolicyRefusal(
                "distributed DP without SecAgg+ would show the server this node's update"
            )
        if not (dp.noise_multiplier > 0 and dp.noise_multiplier >= policy.min_noise):
            raise PolicyRefusal(  # no numbers: the rule alone (its values stay on the node)
                f"the {dp.mechanism} noise multiplier (this node's worst case, counting only the "
                "contributors it can verify) is below this node's min-noise"
            )
        if dp.clip > policy.max_clip:
            raise PolicyRefusal(f"the {dp.mechanism} clip norm is above this node's max-clip")
    if policy.once_per_model:
        check_model_records(content)
        node_ledger(context).claim_model(model_digest(content))
    if policy.max_epsilon > 0 and dp is not None and dp.mechanism == "distributed DP":
        ledger = node_ledger(context)
        # the update, and the training loss at k z unless dp-metric-clip = 0 (privacy.mods)
        loss_clip, loss_scale = loss_release_settings(config)
        round_releases = [dp.noise_multiplier]
        if loss_clip > 0:
            round_releases.append(loss_scale * dp.noise_multiplier)
        projected = gaussian_epsilon([*ledger.releases(), *round_releases], policy.delta, "rdp")
        if projected > policy.max_epsilon:
            raise PolicyRefusal(
                f"{REFUSAL_BUDGET}: one more distributed-DP round would take this node's "
                "epsilon above its max-epsilon"
            )


# The ArrayRecords a train message may carry under once-per-model: fedge's global model and
# strategy state, and Flower's global arrays. Any other one the client would ignore, so it
# would make a new model digest for the same model (a second training on it): refused.
MODEL_RECORDS = frozenset({keys.REC_GLOBAL, keys.REC_STRATEGY, "arrays"})


def check_model_records(content: RecordDict) -> None:
    """Refuse an ArrayRecord outside :data:`MODEL_RECORDS` (it would dodge once-per-model)."""
    if set(content.array_records) - MODEL_RECORDS:
        raise PolicyRefusal(
            "the train message carries an array record this node does not train on (rule: "
            "once-per-model keys on the global model, so nothing beside it may change its digest)"
        )


def check_evaluate(policy: PrivacyPolicy) -> None:
    """Refuse evaluate messages under a strict policy: their replies carry this node's loss
    and example count in clear, for any adapter the server sends (a loss oracle)."""
    if policy.require_secagg or policy.require_dp or policy.max_epsilon > 0:
        raise PolicyRefusal(
            "this node requires SecAgg+ or DP (require-secagg, require-dp or max-epsilon) and an "
            "evaluate reply would carry its own loss in clear; evaluate on the server instead "
            "(client-eval = false)"
        )


def dpsgd_budget(policy: PrivacyPolicy, config: Mapping[str, object]) -> float:
    """The epsilon a DP-SGD client may reach: the smaller of its own and the run's (0: none)."""
    caps = [
        c for c in (policy.max_epsilon, float(str(config.get(keys.CFG_MAX_EPSILON, 0.0)))) if c > 0
    ]
    return min(caps) if caps else 0.0
