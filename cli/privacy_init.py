"""``fedge privacy init``: the strict client policy a deployer should start from, in one directory.

Writes ``policy.toml`` (every rule on: SecAgg+ and DP required, a noise floor, a clip cap,
an epsilon cap, neighbourhood and threshold floors, a trust list, once-per-model), creates
this node's SecAgg+ identity key under ``privacy-state/`` beside it (where the node then
keeps its ledger and identity pins too, :mod:`fedge.clients.privacy.ledger`) and starts the
trust list ``trust.txt`` with this node's own public key. The list is fail-closed: a
neighbour is accepted only once its operator's key is added, one hex key per line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedge.clients.privacy.policy import PrivacyPolicy
from fedge.clients.secagg.mod import write_trust_list

POLICY_FILE = "policy.toml"
TRUST_FILE = "trust.txt"
STATE_DIR = "privacy-state"  # what ledger_root picks beside a policy file

STRICT_PRESET = """\
# fedge client privacy policy: the strict preset (`fedge privacy init`). Point the node at it
# with node config privacy-policy="{policy}" (or FEDGE_PRIVACY_POLICY). Every rule is the
# node's own; the server cannot relax it. docs/privacy.md explains each key and its test.
require-secagg = true        # every train message must be a SecAgg+ stage
require-dp = true            # and carry DP applied on this node (DP-SGD or distributed DP)
min-noise = 1.0              # noise multiplier z >= 1.0, counting only verifiable contributors
max-clip = 1.0               # clip norm C <= 1.0
max-epsilon = 8.0            # stop contributing before this node's epsilon passes 8 (delta 1e-5)
secagg-min-neighbours = 4    # SecAgg+ neighbourhoods of fewer than 4 are refused
secagg-min-threshold = 3     # SecAgg+ thresholds below 3 are refused
trusted-keys = "{trust}"     # neighbours only under these Ed25519 keys (add your operators')
once-per-model = true        # train at most once on each global model
"""


def privacy_init(
    directory: Annotated[Path, typer.Argument(help="Where to write policy.toml and trust.txt.")],
    partition: Annotated[
        int, typer.Option(help="This node's partition-id (names its identity key).")
    ] = 0,
    force: Annotated[bool, typer.Option(help="Overwrite an existing policy.toml.")] = False,
) -> None:
    """Write the strict privacy policy preset, this node's identity key and a trust list."""
    policy_path = directory / POLICY_FILE
    if policy_path.exists() and not force:
        raise typer.BadParameter(f"{policy_path} exists; pass --force to overwrite it")
    directory.mkdir(parents=True, exist_ok=True)
    text = STRICT_PRESET.format(policy=policy_path.absolute(), trust=TRUST_FILE)
    PrivacyPolicy.parse(text, policy_path)  # the preset is a valid policy, or nothing is written
    trust = directory / TRUST_FILE
    if not trust.exists():
        write_trust_list(directory / STATE_DIR, range(partition, partition + 1), trust)
    policy_path.write_text(text)
    own = trust.read_text().split()[0] if trust.read_text().split() else ""
    typer.echo(
        f"wrote {policy_path} (strict preset) and {trust}\n"
        f"this node's SecAgg+ identity (give it to the other operators): {own}\n"
        f"add each neighbour's key to {trust}, then start the node with "
        f"--node-config \"privacy-policy='{policy_path.absolute()}' partition-id={partition}\""
    )
