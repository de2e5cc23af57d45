"""Run every benchmark in this folder (``bench_*.py``) one after another.

    python3 benchmarks/run.py [--quick] [--json-dir DIR]

Each benchmark prints its own table; with ``--json-dir`` each also writes
``DIR/<name>.json``. Benchmarks never fail on time: the exit status is non-zero only
when a benchmark itself could not run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--json-dir", type=Path, help="write each benchmark's JSON here")
    args = parser.parse_args()
    failed = []
    for script in sorted(Path(__file__).resolve().parent.glob("bench_*.py")):
        argv = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        if args.json_dir:
            args.json_dir.mkdir(parents=True, exist_ok=True)
            argv += ["--json", str(args.json_dir / f"{script.stem}.json")]
        print(f"== {script.name}", flush=True)
        if subprocess.run(argv).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"benchmarks that could not run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
