"""SecAgg+ against plain aggregation under Flower's Deployment Engine (real SuperLink, SuperNodes).

The same vector round and timing loop as ``bench/privacy.py`` part 1
(``bench/secagg_rounds.py``), but every message crosses real gRPC: one ``flower-superlink``,
N ``flower-supernode`` processes on 127.0.0.1, and that app run by ``flwr run``; plain and
SecAgg+ (n/2 shares, threshold 2/3) each get one untimed warm-up round. Flower's gRPC grid sleeps 3 s between pulls in ``send_and_receive``; fedge's
aggregators push and then pull with backoff (``fedge.server.grid.exchange_messages``).

Usage: ``python bench/privacy_deploy.py [--clients 10] [--size 100000] [--rounds 3]``. The last
line of output is one JSON object, also written to ``bench/results/privacy_deploy.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from fedge.simulations.localnet import (
    free_ports,
    stop_marked,
    superlink_command,
    supernode_command,
    wait_port,
    write_flwr_home,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS_FILE = REPO / "bench" / "results" / "privacy_deploy.json"
BIN = Path(sys.executable).parent
MARKER_VARIABLE = "FEDGE_BENCH_MARKER"
MARKER = f"fedge-privacy-deploy-{uuid.uuid4().hex}"  # inherited by every process this bench starts

# The app dir holds only names for Flower's loader; the app is bench.secagg_rounds (on PYTHONPATH).
APP = """
from bench import secagg_rounds

client_app = secagg_rounds.client_app
server_app = secagg_rounds.server_app
"""

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedge-privacy-deploy-bench"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedge"

[tool.flwr.app.components]
serverapp = "vector_app:server_app"
clientapp = "vector_app:client_app"

[tool.flwr.app.config]
x-clients = 10
x-size = 100000
x-rounds = 3
x-variants = "plain,secagg_half_shares"
x-out = ""
"""


def run(clients: int, size: int, rounds: int) -> dict[str, Any]:
    """Start a SuperLink and ``clients`` SuperNodes, run the app once, stop them; return times."""
    root = Path(tempfile.mkdtemp(prefix="fedge-privacy-deploy-"))
    app_dir = root / "app"
    app_dir.mkdir()
    (app_dir / "vector_app.py").write_text(APP)
    (app_dir / "pyproject.toml").write_text(PYPROJECT)
    link, *node_ports = free_ports(1 + clients)
    home = root / "flwr"
    write_flwr_home(home, link)
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "FLWR_HOME": str(home),
        "PYTHONPATH": f"{REPO}:{app_dir}",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        MARKER_VARIABLE: MARKER,
    }
    started: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, *args: str) -> None:
        with (root / f"{name}.log").open("wb") as fh:
            started.append(
                subprocess.Popen(list(args), env=env, cwd=root, stdout=fh, stderr=subprocess.STDOUT)
            )

    out = root / "times.json"
    try:
        spawn("superlink", *superlink_command(link, root / "state.db"))
        wait_port(link, timeout=300)
        for pid, port in enumerate(node_ports):
            spawn(f"supernode{pid}", *supernode_command(link, port, pid, clients))
        config = f"x-clients={clients} x-size={size} x-rounds={rounds} x-out='{out}'"
        with (root / "flwr-run.log").open("wb") as fh:  # --stream: returns when the run ends
            subprocess.run(
                ["flwr", "run", str(app_dir), "dep", "--stream", "--run-config", config],
                env=env,
                cwd=root,
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=1800,
                check=False,
            )
    finally:
        for proc in started:  # stop what we started, by pid
            proc.terminate()
        for proc in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            if proc.poll() is None:
                proc.kill()
        stop_marked(MARKER_VARIABLE, MARKER)
    if not out.is_file():
        tail = (root / "flwr-run.log").read_text()[-3000:]
        raise RuntimeError(f"the Deployment Engine run left no timings; flwr run said:\n{tail}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the Deployment Engine bench at each client count; print and write the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="10")
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    result: dict[str, Any] = {
        "bench": "privacy_deploy",
        "vector_size": args.size,
        "rounds": args.rounds,
    }
    for n in (int(c) for c in args.clients.split(",")):
        times = run(n, args.size, args.rounds)
        plain, secagg = (sum(times[k]) / len(times[k]) for k in ("plain", "secagg_half_shares"))
        result[str(n)] = {
            "plain_s": round(plain, 3),
            "secagg_s": round(secagg, 3),
            "ratio": round(secagg / plain, 3),
            "secagg_stage_s": times.get("secagg_half_shares_stages", {}),
            "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        }
        print(f"deployment n={n}: {result[str(n)]}", flush=True)
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result)
    RESULTS_FILE.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
