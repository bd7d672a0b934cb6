"""The device mod and the virtual clock agree on a device's step budget: the tighter one wins."""

from __future__ import annotations

import time
from typing import Any

from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict

from fedge import keys
from fedge.simulations.devices import device_mod


def _budget_seen(config: dict[str, Any]) -> int:
    """The ``step-budget`` the ClientApp receives behind ``device_mod``."""
    metadata = Metadata(1, "m", 0, 1, "", "1", time.time(), 3600.0, "train")
    msg = Message(content=RecordDict({keys.REC_CONFIG: ConfigRecord(config)}), metadata=metadata)
    context = Context(1, 1, {keys.NODE_PARTITION_ID: 0}, RecordDict(), {})
    seen: list[int] = []

    def app(m: Message, _c: Context) -> Message:
        seen.append(int(m.content.config_records[keys.REC_CONFIG][keys.CFG_STEP_BUDGET]))
        return m

    device_mod(msg, context, app)
    return seen[0]


STRAGGLER = {
    keys.CFG_LOCAL_STEPS: 8,
    keys.CFG_SEED: 0,
    keys.CFG_SERVER_ROUND: 1,
    "straggler-fraction": 1.0,  # always a straggler, doing half its steps: 4 of 8
    "straggler-work": 0.5,
}


def test_the_mod_never_raises_a_budget_the_deadline_cut() -> None:
    """The clock cut this device to 2 steps (deadline); its straggler budget is 4. It must run 2
    (on main the mod overwrote the clock's budget with 4: a device cut by the deadline ran more)."""
    assert _budget_seen({**STRAGGLER, keys.CFG_STEP_BUDGET: 2}) == 2


def test_the_mod_caps_a_looser_budget_and_sets_one_where_none_was() -> None:
    """A clock budget of 6 is looser than the straggler's 4: 4. No budget set: the straggler's 4."""
    assert _budget_seen({**STRAGGLER, keys.CFG_STEP_BUDGET: 6}) == 4
    assert _budget_seen(dict(STRAGGLER)) == 4
