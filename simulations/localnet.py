"""Local Deployment Engine plumbing: free loopback ports, waiting for a listener, stopping what we started.

Tests and benches that start a real ``flower-superlink`` and ``flower-supernode`` processes
mark every process with an environment variable, so the app processes the SuperNodes
spawn can be found and stopped by pid afterwards, and nothing else is touched. A Ray node
started here (:func:`ray_head`) is marked and stopped the same way, never with `ray stop`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fedge.ports import free_ports


def listens(proc: subprocess.Popen[bytes], port: int) -> bool:
    """Whether ``proc`` (or a process it started) listens on TCP ``port``."""
    try:
        root = psutil.Process(proc.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for member in family:
        with contextlib.suppress(psutil.Error):
            for conn in member.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                    return True
    return False


def start_listening(
    command: Callable[[int], list[str]],
    log: Path,
    timeout: float = 120,
    attempts: int = 5,
    **popen: Any,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``command(port)`` on a free port and return once that process listens on it.

    The port was free when chosen, but another process can bind it before the child does: the
    child then exits (bind failure), and this tries again on a new port. Output goes to ``log``.
    """
    for _ in range(attempts):
        (port,) = free_ports(1)
        with log.open("ab") as out:
            proc = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT, **popen)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and not listens(proc, port):
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{command(port)[0]} did not listen on {port} in {timeout} s")
            time.sleep(0.1)
        if proc.poll() is None:
            return proc, port
    raise RuntimeError(f"{command(0)[0]} failed to bind a port {attempts} times; see {log}")


def wait_port(port: int, timeout: float = 60) -> None:
    """Return once something listens on 127.0.0.1:``port``; raise after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def stop_marked(variable: str, marker: str) -> None:
    """Stop, by pid, every process whose environment has ``variable=marker`` (never this one)."""
    procs = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get(variable) == marker:
                procs.append(proc)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def write_flwr_home(home: Path, link_port: int) -> Path:
    """Write ``home/config.toml`` naming a local insecure SuperLink federation ``dep``."""
    home.mkdir(parents=True, exist_ok=True)
    config = home / "config.toml"
    config.write_text(
        f'[superlink]\ndefault = "dep"\n\n[superlink.dep]\naddress = "127.0.0.1:{link_port}"\n'
        "insecure = true\n"
    )
    return config


def superlink_command(port: int, database: Path) -> list[str]:
    """The ``flower-superlink`` command line for an insecure SuperLink on 127.0.0.1:``port``."""
    return [
        "flower-superlink",
        "--insecure",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database",
        str(database),
    ]


def local_superlink_command(port: int, home: Path) -> list[str]:
    """What ``flwr run . local`` starts (a simulation SuperLink), on 127.0.0.1:``port``.

    Started ahead by a caller that waits for it (``start_listening``), ``flwr run`` finds it on
    ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and uses it, instead of starting its own and giving
    it a fixed 15 s, which a loaded machine can exceed.
    """
    runtime = home / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)
    return [
        "flower-superlink",
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database",
        str(runtime / "state.db"),
    ]


def wait_healthy(port: int, timeout: float = 120) -> None:
    """Return once the SuperLink's HTTP API on 127.0.0.1:``port`` answers its health check."""
    deadline = time.monotonic() + timeout
    while True:
        url = f"http://127.0.0.1:{port}/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5):
            return  # answered 2xx (refused, reset or an error status raise OSError)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the SuperLink on {port} is not healthy after {timeout} s")
        time.sleep(0.2)


def supernode_command(link_port: int, port: int, partition: int, partitions: int) -> list[str]:
    """The ``flower-supernode`` command line for one partition, talking to the local SuperLink."""
    return [
        "flower-supernode",
        "--insecure",
        "--superlink",
        f"127.0.0.1:{link_port}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--node-config",
        f"partition-id={partition} num-partitions={partitions}",
    ]


RAY_NODE_MARKER = "FEDGE_RAY_NODE"  # set on a `ray start` and inherited by its node's processes
RAY_ADDRESS_FILE = "ray_current_cluster"  # written in its temp dir once `ray start` is up


def ray_node_command(temp_dir: Path, num_cpus: int = 1, head_port: int | None = None) -> list[str]:
    """`ray start --block` for one node on 127.0.0.1 with ``num_cpus`` CPUs, its own temp dir and
    ports (Ray's fixed defaults would collide with any other Ray on the machine): a head
    (listening on the ``--port=`` given) without ``head_port``, else a node joining that head.
    Terminating the command stops its node's processes."""
    ports = free_ports(10)
    cmd = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        f"--node-manager-port={ports[0]}",
        f"--object-manager-port={ports[1]}",
        f"--dashboard-agent-listen-port={ports[2]}",
        f"--dashboard-agent-grpc-port={ports[3]}",
        f"--runtime-env-agent-port={ports[4]}",
        f"--metrics-export-port={ports[5]}",
        f"--min-worker-port={ports[6]}",
        f"--max-worker-port={ports[6] + 60}",
    ]
    if head_port is None:
        return [
            *cmd,
            "--head",
            f"--port={ports[7]}",
            f"--ray-client-server-port={ports[8]}",
            f"--dashboard-port={ports[9]}",
            "--include-dashboard=false",
        ]
    return [*cmd, f"--address=127.0.0.1:{head_port}"]


def head_port(command: Sequence[str]) -> int:
    """The port a head's :func:`ray_node_command` listens on (its ``--port=``)."""
    return next(int(a.split("=", 1)[1]) for a in command if a.startswith("--port="))


@dataclass(frozen=True)
class RayHead:
    """A running Ray head: its address (for ``RAY_ADDRESS``) and its temp dir."""

    address: str
    temp_dir: Path

    @property
    def logs(self) -> Path:
        """The session's log directory (a ``python-core-driver-*`` log per driver that joined)."""
        return self.temp_dir / "session_latest" / "logs"


@contextlib.contextmanager
def ray_head(
    env: Mapping[str, str],
    log: Path,
    num_cpus: int = 1,
    extra: tuple[str, ...] = (),
    attempts: int = 3,
    timeout: float = 180,
) -> Iterator[RayHead]:
    """Start a Ray head on 127.0.0.1 (:func:`ray_node_command` plus ``extra`` arguments) for the
    block; its processes inherit ``env``; `ray start` writes to ``log``.

    Ray gives the raylet a fixed 30 s to register with the GCS (``raylet_start_wait_time_s`` in
    ``ray/_private/node.py``), which a loaded machine overruns: `ray start` then exits ("The
    current node timed out during startup"), and this starts it again on fresh ports, up to
    ``attempts`` times. The head is up once `ray start` has written its address file. Each
    attempt's processes carry their own :data:`RAY_NODE_MARKER`, so the head (or a failed
    attempt's leftovers) is stopped by pid, and no other Ray on the machine is touched.
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="fr", dir="/tmp"))  # short: socket paths are limited
    base = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}  # a head of its own, joining none
    try:
        for _ in range(attempts):
            marker = uuid.uuid4().hex
            cmd = [*ray_node_command(temp_dir, num_cpus), *extra]
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    cmd, env={**base, RAY_NODE_MARKER: marker}, stdout=out, stderr=out
                )
            try:
                if wait_for_file(temp_dir / RAY_ADDRESS_FILE, proc, timeout):
                    yield RayHead(f"127.0.0.1:{head_port(cmd)}", temp_dir)
                    return
            finally:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
                stop_marked(RAY_NODE_MARKER, marker)
        raise RuntimeError(f"ray start failed {attempts} times; see {log}")
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_file(
    path: Path, proc: subprocess.Popen[bytes], timeout: float, poll_s: float = 0.2
) -> bool:
    """True once ``path`` exists (checked every ``poll_s``); False if ``proc`` exited first;
    raise after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(poll_s)
    return True
