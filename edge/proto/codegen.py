"""Regenerate the verifier's Python stubs from `verifier.proto` with grpc_tools.protoc.

Run `python -m fedge.edge.proto.codegen` (or `make proto`) after editing the proto; the
generated `*_pb2.py`, `*_pb2_grpc.py` and `*_pb2.pyi` are committed and never
edited by hand. Imports in the generated gRPC module are rewritten to the
package path so they resolve without touching `sys.path`.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "verifier.proto"
GENERATED = ("verifier_pb2.py", "verifier_pb2_grpc.py", "verifier_pb2.pyi")


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on `verifier.proto`, writing the stubs into `out_dir`; returns their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_FILE}: fix the proto and rerun")
    grpc_module = out_dir / "verifier_pb2_grpc.py"
    text = grpc_module.read_text()
    grpc_module.write_text(
        text.replace("import verifier_pb2 as", "from fedge.edge.proto import verifier_pb2 as")
    )
    return [out_dir / name for name in GENERATED]


def main() -> int:
    """Console entry: regenerate the stubs in place."""
    for path in generate():
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
