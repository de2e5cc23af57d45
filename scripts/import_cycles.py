"""Import circles among corral's modules (``python scripts/import_cycles.py``).

Counts every import of a corral module, at module level, inside a function (a lazy
import that only breaks a circle still is one) or under ``if TYPE_CHECKING:`` (a
circle the type checker sees is a circle of the design: name the shared type in a
module below both, or describe what is needed with a ``Protocol``). Prints one
circle per line and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in mods else node.module
                    if target in mods and target != name:
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != name:
                        edges[name].add(alias.name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


# Type-only circles that came in before this script counted them, to be broken like
# the others (a Protocol for what ``_spread``/``_travel`` use of the router); listed
# so that no new one can come in meanwhile. Remove an entry once it is broken.
KNOWN_TYPE_ONLY: list[list[str]] = []


def main() -> int:
    found = circles(graph())
    new = [c for c in found if c not in KNOWN_TYPE_ONLY]
    for circle in found:
        print(("" if circle in new else "known, to break: ") + " <-> ".join(circle))
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
