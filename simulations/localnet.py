"""Local Deployment Engine plumbing: free loopback ports, waiting for a listener, stopping what we started.

Tests and benches that start a real ``flower-superlink`` and ``flower-supernode`` processes
mark every process with an environment variable, so the app processes the SuperNodes
spawn can be found and stopped by pid afterwards, and nothing else is touched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import psutil


def free_ports(n: int) -> list[int]:
    """``n`` currently free TCP ports on 127.0.0.1."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


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
