"""`fedge verifier serve` as a real process (drains on SIGTERM) answering `fedge edge generate`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.zoo import ZooPaths

FEDGE = [sys.executable, "-m", "fedge.cli"]


def test_serve_then_generate_then_sigterm(micro_zoo: ZooPaths, tmp_path: Path) -> None:
    env = {**os.environ, "FEDGE_VERIFIER_TOKEN": "t0ken", "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        [
            *FEDGE,
            "verifier",
            "serve",
            "--model",
            str(micro_zoo.target_dir),
            "--port",
            "0",
            "--grace-s",
            "1",
            "--runtime",
            "torch",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, f"unexpected first line {line!r}"
        generated = CliRunner().invoke(
            app,
            [
                "edge",
                "generate",
                "--verifier",
                f"127.0.0.1:{match.group(1)}",
                "--draft",
                str(micro_zoo.draft_dir),
                "--prompt",
                "def main():\n    ",
                "--max-new-tokens",
                "12",
                "--route",
                "speculative",
            ],
            env={"FEDGE_VERIFIER_TOKEN": "t0ken"},
        )
        assert generated.exit_code == 0, generated.output
        report = json.loads(generated.stderr[generated.stderr.index("{") :])
        assert report["route"] == "speculative" and report["tokens"] == 12
        assert report["draft_runtime"] == "torch" and report["bytes_up"] > 0
    finally:
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        server.stdout.close()  # type: ignore[union-attr]
        server.stderr.close()  # type: ignore[union-attr]
