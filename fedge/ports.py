"""Loopback ports that a listener started later can bind: chosen below the kernel's ephemeral range.

A port probed free and bound later (by a child process, by Ray's actor, after a restart) could
meanwhile be handed to any server binding port 0 or to any outgoing connection, when it lies in
the ephemeral range; below it, only another explicit bind can take it, and fedge's listeners
bind exclusively, so that fails loudly instead of sharing the port.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST = 20_000  # above Ray's default worker ports (10002-19999)


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (port 0 binds and outgoing connections)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` now, below the ephemeral range."""
    high = ephemeral_low()
    low = LOWEST if high > LOWEST + 1_000 else 1024
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(64 * n):
        port = rng.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
        if len(ports) == n:
            return ports
    raise OSError(f"found {len(ports)} of {n} free ports on {host} in {low}-{high - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now, below the ephemeral range (`free_ports`)."""
    return free_ports(1, host)[0]
