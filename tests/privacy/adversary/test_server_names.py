"""A server that names paths on the client: data, models and state outside the node's roots.

The weakness (issue 18): the server named local paths on the client. On main (RUN, commit
79c277a, a script sending the real ClientApp one SCAFFOLD train message built by the
server's ``train_content`` with ``data-source``, ``client-state-dir`` and ``model`` set to
absolute paths outside anything the node configured) the client trained on the server's
directory (180 examples: the planted ``victim/secret.py``), loaded the model it was pointed
at, and wrote ``<client-state-dir>/run1/partition_0000/round_1.npz`` there; with
``run-id = ../../esc`` the same write landed two directories further up. Now every such key
is an identifier resolved under this node's roots (:mod:`fedge.names`): an absolute name, a
``..`` step or a symlink leading out of the root is refused, naming the key, before any
model or data is loaded, and nothing outside the roots is read or written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

import fedge.clients.app as client_module
from fedge import keys
from fedge.lm import holder
from fedge.names import UnsafeName, resolve_config
from tests.clients.test_client_app import message_to_node

ATTACKED = [
    keys.CFG_DATA_SOURCE,
    keys.CFG_MODEL,
    keys.CFG_DISTILL_TEACHER,
    keys.CFG_CLIENT_STATE_DIR,
    keys.CFG_RUN_ID,
]


@pytest.fixture
def node(tmp_path: Path) -> tuple[dict[str, object], Path]:
    """A node with its three roots, and an outside directory holding what the server aims at:
    a client-per-directory data tree, a model dir and an empty state dir."""
    roots = {kind: tmp_path / "node" / kind for kind in ("data", "models", "state")}
    for root in roots.values():
        root.mkdir(parents=True)
    outside = tmp_path / "outside"
    (outside / "data" / "victim").mkdir(parents=True)
    (outside / "data" / "victim" / "secret.py").write_text("PASSWORD = 'hunter2'\n" * 50)
    (outside / "models").mkdir()
    (outside / "state").mkdir()
    node_config = {
        keys.NODE_PARTITION_ID: 0,
        "data-root": str(roots["data"]),
        "model-root": str(roots["models"]),
        "state-root": str(roots["state"]),
    }
    return node_config, outside


def _aim(key: str, how: str, node_config: dict[str, object], outside: Path) -> str:
    """The value a malicious server sends for ``key``: absolute, ``..``, or a planted symlink."""
    target = {
        keys.CFG_DATA_SOURCE: "data",
        keys.CFG_CLIENT_STATE_DIR: "state",
        keys.CFG_RUN_ID: "state",
    }.get(key, "models")
    if how == "absolute":
        return str(outside / target)
    if how == "dotdot":
        return f"../../../outside/{target}"
    root_key = {"data": "data-root", "models": "model-root", "state": "state-root"}[target]
    root = Path(str(node_config[root_key]))
    if key == keys.CFG_RUN_ID:  # the run id names a directory under <state-root>/<state-dir>
        root = root / "client-state"
        root.mkdir()
    (root / "planted").symlink_to(outside / target, target_is_directory=True)
    return "planted"


def _train_message(config: dict[str, object]) -> Message:
    content = RecordDict({keys.REC_CONFIG: ConfigRecord(config)})  # type: ignore[arg-type]
    return message_to_node(content, "train")


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
@pytest.mark.parametrize("key", ATTACKED)
def test_a_server_naming_anything_outside_the_roots_is_refused(
    node: tuple[dict[str, object], Path], key: str, how: str
) -> None:
    """Each named key, each way out: the real ClientApp refuses naming the key; nothing loaded,
    nothing read or written outside the roots."""
    node_config, outside = node
    config: dict[str, object] = {
        keys.CFG_MODEL: "zoo:micro",
        keys.CFG_STRATEGY: "scaffold",
        keys.CFG_CLIENT_STATE_DIR: "client-state",
        keys.CFG_RUN_ID: "run1",
    }
    config[key] = _aim(key, how, node_config, outside)
    before = dict(holder.STATS)
    context = Context(
        run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={}
    )
    with pytest.raises(UnsafeName, match=f"'{key}'"):
        client_module.app(_train_message(config), context)
    assert holder.STATS["model_loads"] == before["model_loads"]
    assert holder.STATS["corpus_loads"] == before["corpus_loads"]
    assert not any((outside / "state").iterdir())  # no state written where the server said
    assert not any((outside / "models").iterdir())


def test_identifiers_under_the_roots_resolve_to_the_nodes_own_paths(
    node: tuple[dict[str, object], Path],
) -> None:
    """The honest case: names under the roots resolve there; a zoo preset and a hub id pass."""
    node_config, _ = node
    data = Path(str(node_config["data-root"])) / "mydata"
    (data / "alice").mkdir(parents=True)
    model = Path(str(node_config["model-root"])) / "org" / "base"
    model.mkdir(parents=True)
    config = {keys.CFG_DATA_SOURCE: "mydata", keys.CFG_MODEL: "org/base", keys.CFG_RUN_ID: "r"}
    resolved = resolve_config(config, node_config)  # type: ignore[arg-type]
    assert resolved[keys.CFG_DATA_SOURCE] == str(data.resolve())
    assert resolved[keys.CFG_MODEL] == resolved[keys.CFG_MODEL_PATH] == str(model.resolve())
    hub = resolve_config({keys.CFG_MODEL: "Qwen/Qwen2.5-0.5B-Instruct"}, node_config)
    assert hub[keys.CFG_MODEL] == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(UnsafeName, match="zoo preset"):
        resolve_config({keys.CFG_MODEL: "zoo:../../x"}, node_config)


def test_a_built_in_corpus_is_named_not_resolved_and_nothing_else_passes_as_one(
    node: tuple[dict[str, object], Path],
) -> None:
    """``corpus:indent2`` names a corpus built from the node's own stdlib, so it passes as given
    (no root is searched); a ``corpus:`` name that is not built in, such as a path smuggled
    behind the prefix, is refused naming the key, before any data is loaded."""
    node_config, outside = node
    resolved = resolve_config({keys.CFG_DATA_SOURCE: "corpus:indent2"}, node_config)  # type: ignore[arg-type]
    assert resolved[keys.CFG_DATA_SOURCE] == "corpus:indent2"
    for value in ("corpus:../../outside/data", f"corpus:{outside / 'data'}", "corpus:"):
        with pytest.raises(UnsafeName, match=f"'{keys.CFG_DATA_SOURCE}'.*corpus:indent2"):
            resolve_config({keys.CFG_DATA_SOURCE: value}, node_config)  # type: ignore[arg-type]
