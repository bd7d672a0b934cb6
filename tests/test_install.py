"""fedge as a library a Flower user installs: a light core, its extras, and the wheel.

``pip install fedge`` (the core) gives a Flower user fedge's strategies, SecAgg+, DP and the
client half with flwr, torch, numpy and cryptography only; the LoRA federation, the edge
service and the fleet are the ``lora``, ``edge`` and ``fleet`` extras (``all`` for all).

The default run checks the built wheel (its files through the ``fedge/<part>`` symlinks and
its core requirements) and that importing the core loads none of the extras' packages.
``make test-install`` (marker ``install``, minutes) installs the wheel into a fresh venv
beside a user's own ``server.py``/``client.py`` and imports both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What a Flower user imports from fedge (docs/federation.md), and fedge itself.
CORE_MODULES = (
    "fedge",
    "fedge.strategies",
    "fedge.strategies.fedavg",
    "fedge.strategies.fedprox",
    "fedge.strategies.scaffold",
    "fedge.strategies.robust",
    "fedge.strategies.client",
    "fedge.server.secagg.strategy",
    "fedge.server.privacy.aggregators",
    "fedge.server.privacy.accountant",
    "fedge.clients.mods",
    "fedge.clients.secagg.mod",
    "fedge.clients.privacy.mods",
    "fedge.clients.privacy.dpsgd",
    "fedge.privacy.accounting",
    "fedge.strategies.flower_dp",
    "fedge.server.privacy.strategy",
    "fedge.server.privacy.release",
    "fedge.clients.privacy.private",
)
# Packages the core must not load (the extras' packages, and their big dependencies).
HEAVY = (
    "transformers",
    "peft",
    "tokenizers",
    "safetensors",
    "datasets",
    "flwr_datasets",
    "ray",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "redis",
    "opentelemetry",
    "prometheus_client",
    "tensorboard",
    "matplotlib",
    "opacus",
    "dp_accounting",
    "scipy",
    "mlflow",
    "gguf",
)
PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation")
NOT_SOURCE = (".git", ".venv", ".fedge-cache", "runs", "build", "dist", "*.egg-info", "__pycache__")
NOT_SOURCE += (".mypy_cache", ".ruff_cache", ".pytest_cache")
CORE_REQUIRES = {"flwr", "torch", "numpy", "cryptography"}
# Installed by the extras only: a core install must not bring them.
NOT_IN_CORE_INSTALL = ("transformers", "peft", "ray", "onnxruntime", "opacus", "redis")


RUN_EXAMPLE = """
import json, os, sys, tomllib
from pathlib import Path

example, package, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
sys.path.insert(0, str(example))
from fedge.clients.privacy.ledger import STATE_DIR_ENV

os.environ[STATE_DIR_ENV] = str(out / "keys")
client_app = __import__(package + ".client_app", fromlist=["app"])
server_app = __import__(package + ".server_app", fromlist=["app"])

from fedge.simulations.inprocess import DeviceTable, InProcessGrid, run_inprocess

config = tomllib.loads((example / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
config = {**config, **{k: v.replace("OUT", str(out)) if isinstance(v, str) else v
                       for k, v in json.loads(sys.argv[4]).items()}}
grid = InProcessGrid(client_app.app, DeviceTable(4), out / "state")
run_inprocess(server_app.app, grid, run_config=config)
loaded = [h for h in sys.argv[5].split(",") if h in sys.modules]
print(json.dumps({"files": sorted(p.name for p in out.iterdir()), "loaded": loaded}))
"""
# examples/<dir>, its package, its run config beyond the defaults, the files it must write
EXAMPLES = (
    (
        "flower-app",
        "flowerapp",
        {"strategy": "scaffold-secagg", "num-server-rounds": 2, "final-model": "OUT/m.pt"},
        "m.pt",
    ),
    (
        "flower-dp",
        "flowerdp",
        {"privacy": "distributed", "num-server-rounds": 2, "num-nodes": 4, "out-dir": "OUT"},
        "train_metrics.json",
    ),
)


def test_core_imports_load_no_extra() -> None:
    """Importing what a Flower user imports leaves every extra's package out of sys.modules.

    Before the extras split nothing checked this: one top-level ``import transformers`` in a
    module the strategies reach would cost every Flower app seconds and a 129 MB package.
    """
    code = (
        "import importlib, json, sys\n"
        f"for m in {CORE_MODULES!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def build_wheel(dest: Path) -> Path:
    """``pip wheel`` of a copy of this checkout (no isolation: setuptools of the running venv;
    the copy keeps the ``fedge/<part>`` symlinks and keeps build/ and egg-info out of the repo)."""
    source = dest / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    subprocess.run(
        [*PIP_WHEEL, "-q", "-w", str(dest), str(source)],
        check=True,
        capture_output=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = dest.glob("fedge-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_files_and_core_requirements(wheel: Path) -> None:
    """The wheel holds every part under ``fedge/`` (through the symlinks), the .proto and
    scenario files, no top-level ``server``/``clients``/... package, and the core requires
    flwr, torch, numpy and cryptography only."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fedge", meta_name.split("/")[0]}, tops
    for path in (
        "fedge/server/secagg/strategy.py",
        "fedge/clients/mods.py",
        "fedge/strategies/scaffold.py",
        "fedge/edge/proto/verifier.proto",
        "fedge/simulations/scenarios/default.toml",
        "fedge/cli/main.py",
        "fedge/py.typed",
    ):
        assert path in names, path
    requires = meta.get_all("Requires-Dist") or []
    core = {r.split(";")[0] for r in requires if "extra ==" not in r}
    assert {r.split("<")[0].split(">")[0].split("=")[0].strip() for r in core} == CORE_REQUIRES
    assert "flwr[simulation]" not in " ".join(core)
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"dp", "lora", "edge", "fleet", "all"} <= extras
    lora = [r for r in requires if 'extra == "lora"' in r]
    assert any(r.startswith("transformers") for r in lora)


@pytest.mark.install
@pytest.mark.timeout(1500)
def test_fresh_venv_core_install(wheel: Path, tmp_path: Path) -> None:
    """``pip install fedge-*.whl`` into a fresh venv (no system site-packages, torch from the
    local wheel first): the extras' packages are not installed, and a user's own ``server``
    and ``client`` modules import beside ``fedge.server``/``fedge.clients`` without either
    shadowing the other (before the namespace move the wheel installed a top-level
    ``server`` package, and the user's ``import server`` got fedge's). The Flower apps of
    examples/ then run SCAFFOLD under SecAgg+ and distributed DP on that core install alone."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, env=env)
    start = time.monotonic()
    subprocess.run([*pip, str(wheel)], check=True, env=env)
    seconds = time.monotonic() - start
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"core install (after torch): {seconds:.1f} s, load {' '.join(load)}")
    (tmp_path / "install.json").write_text(json.dumps({"seconds": seconds, "load": load}))

    app = tmp_path / "app"
    app.mkdir()
    (app / "server.py").write_text("WHO = 'user server'\n")
    (app / "client.py").write_text("WHO = 'user client'\n")
    check = (
        "import importlib.util, json, sys\n"
        "import server, client\n"
        "import fedge.server.secagg.strategy as s, fedge.clients.mods as m\n"
        "from fedge.strategies.scaffold import Scaffold\n"
        "from fedge.strategies.client import TrainRound\n"
        "print(json.dumps({'server': server.WHO, 'client': client.WHO,\n"
        "  'fedge_server': s.__file__, 'fedge_clients': m.__file__,\n"
        f"  'missing': [p for p in {NOT_IN_CORE_INSTALL!r} if importlib.util.find_spec(p) is None],\n"
        f"  'loaded': sorted(h for h in {HEAVY!r} if h in sys.modules)}}))\n"
    )
    out = subprocess.run(
        [str(py), "-c", check], check=True, capture_output=True, text=True, cwd=app, env=env
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["server"] == "user server" and got["client"] == "user client"
    site = str(env_dir)
    assert got["fedge_server"].startswith(site) and got["fedge_clients"].startswith(site)
    assert got["missing"] == list(NOT_IN_CORE_INSTALL)
    assert got["loaded"] == []
    # the Flower apps of examples/ run on the core alone: SCAFFOLD under SecAgg+, and
    # distributed DP (SecAgg+ with noise, epsilon by the core's RDP) with its epsilon reported
    for name, package, config, written in EXAMPLES:
        out = tmp_path / name
        out.mkdir()
        argv = [str(REPO / "examples" / name), package, str(out), json.dumps(config)]
        run = subprocess.run(
            [str(py), "-c", RUN_EXAMPLE, *argv, ",".join(HEAVY)],
            capture_output=True,
            text=True,
            cwd=app,
            env=env,
            timeout=900,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert written in got["files"] and got["loaded"] == [], got
        logs = run.stdout + run.stderr
        assert "aggregate_train: Received 4 results and 0 failures" in logs, logs[-3000:]
        assert "fedge: fedge SecAgg+ around" in logs, logs[-3000:]
    metrics = json.loads((tmp_path / "flower-dp" / "train_metrics.json").read_text())
    assert "dp-epsilon" in json.dumps(metrics), metrics
    cli = subprocess.run(
        [str(env_dir / "bin" / "fedge"), "--help"], capture_output=True, text=True, env=env
    )
    assert cli.returncode != 0 and "pip install 'fedge[all]'" in cli.stderr, cli.stderr[-2000:]
    pip_check = subprocess.run(
        [str(py), "-m", "pip", "check"], capture_output=True, text=True, env=env
    )
    assert pip_check.returncode == 0, pip_check.stdout
