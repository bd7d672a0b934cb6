"""`fedge verifier serve` in a child process on 127.0.0.1:0, for benches that need a real server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


class VerifierProcess:
    """A verifier process of its own, as deployed: started here, stopped or killed by its pid."""

    def __init__(
        self,
        model_dir: Path,
        max_batch: int = 32,
        torch_threads: int = 1,
        extra_args: Sequence[str] = (),
        runtime: str = "torch",
    ) -> None:
        """`extra_args`: more `fedge verifier serve` options (e.g. `--credentials FILE`).
        `runtime` is torch unless asked: `auto` (the CLI's default) exports the model to ONNX
        on first use and picks by measurement, which a bench of one runtime must not."""
        command = [
            *(sys.executable, "-m", "fedge.edge.verifier", "--model", str(model_dir)),
            *("--port", "0", "--max-batch", str(max_batch), "--batch-window-ms", "2"),
            *("--torch-threads", str(torch_threads), "--grace-s", "1", "--max-draft", "16"),
            *("--runtime", runtime),
            *extra_args,
        ]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r":(\d+)$", line.strip())
        if not match:
            self.stop()
            raise RuntimeError(f"verifier did not start: {line!r}")
        self.port = int(match.group(1))

    def kill(self) -> None:
        """SIGKILL: a crash, no drain."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then wait for the drain."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
