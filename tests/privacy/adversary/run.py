"""Run the random malicious server (:mod:`tests.privacy.adversary.malicious`) at any size.

    python -m tests.privacy.adversary.run --n 10000 --seed 1 [--json out.json]

Prints the deviation classes and counts, the outcomes and every broken promise found;
exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.privacy.adversary.malicious import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=10_000, help="deviations to run (at least)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    report = run(args.n, args.seed)
    out = {
        **report.as_dict(),
        "seed": args.seed,
        "seconds": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 1 if report.breaches else 0


if __name__ == "__main__":
    sys.exit(main())
