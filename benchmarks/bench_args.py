"""The flags every ``bench_*.py`` takes, and how each picks its sizes from them.

- ``--quick``: fewer samples (figures still worth reading);
- ``--smoke``: the smallest sizes that still run every code path once — what ``make test``
  runs (``tests/test_benchmarks.py``) so no benchmark rots; its figures mean nothing;
- ``--json OUT``: also write the figures to OUT.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with ``--quick``, ``--smoke`` and ``--json``."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes: proves the benchmark runs; the figures mean nothing")
    ap.add_argument("--json", type=Path, help="also write the figures here as JSON")
    return ap


def pick(args: argparse.Namespace, full: T, quick: T, smoke: T) -> T:
    """``smoke`` under ``--smoke``, ``quick`` under ``--quick``, else ``full``."""
    if getattr(args, "smoke", False):
        return smoke
    return quick if args.quick else full
