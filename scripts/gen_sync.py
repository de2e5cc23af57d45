#!/usr/bin/env python3
"""Generate corral's blocking client from its asyncio source (httpcore's approach).

The client is written once, as asyncio code in ``src/corral/client/_async/``; this
script rewrites each module into ``src/corral/client/_sync/`` by plain token
substitution (``AsyncSandbox`` → ``Sandbox``, ``async def`` → ``def``, ``await x``
→ ``x``, ...). Anything substitution cannot express belongs in
``corral/client/_backends.py`` (``AsyncBackend`` / ``SyncBackend``).

    python scripts/gen_sync.py           # regenerate _sync/
    python scripts/gen_sync.py --check   # exit 1 if _sync/ is stale (CI, tests)
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "corral" / "client" / "_async"
TARGET = ROOT / "src" / "corral" / "client" / "_sync"
HEADER = (
    "# Generated from _async/{name} by scripts/gen_sync.py: edit that file, not this one.\n"
    "# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)\n"
)

# Order matters: a specific rule must come before the generic Async* rule.
SUBS = [
    ("AsyncBackend", "SyncBackend"),
    ("Async([A-Z][A-Za-z0-9_]*)", r"\1"),  # AsyncSandbox, AsyncIterator, httpx.AsyncClient...
    ("async def", "def"),
    ("async with", "with"),
    ("async for", "for"),
    ("await ", ""),
    ("__aenter__", "__enter__"),
    ("__aexit__", "__exit__"),
    ("__aiter__", "__iter__"),
    ("__anext__", "__next__"),
    ("aclose", "close"),
    ("aiter_lines", "iter_lines"),
    ("aiter_bytes", "iter_bytes"),
    ("aread", "read"),
    ("_async", "_sync"),
]


def _compile(pattern: str) -> re.Pattern[str]:
    # Whole words only: "aread" must not touch "already". A pattern that ends in a
    # space ("await ") needs no boundary after it.
    tail = "" if pattern.endswith(" ") else r"(?!\w)"
    return re.compile(r"(?<!\w)" + pattern + tail)


COMPILED = [(_compile(pattern), repl) for pattern, repl in SUBS]


def unasync_line(line: str, used: set[int] | None = None) -> str:
    for index, (regex, repl) in enumerate(COMPILED):
        new = regex.sub(repl, line)
        if new != line and used is not None:
            used.add(index)
        line = new
    return line


def generate(source: Path, used: set[int] | None = None) -> str:
    lines = source.read_text().splitlines(keepends=True)
    return HEADER.format(name=source.name) + "".join(unasync_line(ln, used) for ln in lines)


def expected_files(used: set[int] | None = None) -> dict[Path, str]:
    return {TARGET / src.name: generate(src, used) for src in sorted(SOURCE.glob("*.py"))}


def stale_files(expected: dict[Path, str]) -> list[str]:
    """Human-readable differences between ``_sync/`` and what it should be."""
    problems = []
    for path, text in expected.items():
        current = path.read_text() if path.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                f"{path.relative_to(ROOT)} (now)", f"{path.relative_to(ROOT)} (expected)",
            )
            problems.append("".join(list(diff)[:40]))
    for path in sorted(TARGET.glob("*.py")):
        if path not in expected:
            problems.append(f"{path.relative_to(ROOT)}: has no source in {SOURCE.relative_to(ROOT)}\n")
    return problems


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__.strip().splitlines()[-2:], file=sys.stderr)
        return 2
    used: set[int] = set()
    expected = expected_files(used)
    if argv == ["--check"]:
        problems = stale_files(expected)
        if problems:
            print("".join(problems), file=sys.stderr)
            print("the blocking client is stale: run python scripts/gen_sync.py", file=sys.stderr)
            return 1
        return 0
    TARGET.mkdir(exist_ok=True)
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in TARGET.glob("*.py"):
        if path not in expected:
            path.unlink()
            print(f"removed {path.relative_to(ROOT)}")
    unused = [SUBS[i][0] for i in range(len(SUBS)) if i not in used]
    if unused:
        print(f"note: substitutions never used: {', '.join(unused)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
