"""The SDK's side of corral runs on Python 3.10 (issue 25, item 2): no module the client
imports uses what came in 3.11. A quick static check, so a new module that reaches for
``typing.Self`` fails here, not only in tests/packaging (which installs the wheel on a
real 3.10 but needs the package index)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "corral"
CLIENT_SIDE = ["client", "cli", "rl", "cluster", "guest", "api", "__init__.py", "errors.py",
               "schema.py", "image_schema.py", "pool_schema.py", "volume_schema.py",
               "network_schema.py",
               "_bridge.py", "_version.py"]
# names that exist only from 3.11 (typing_extensions has the typing ones)
NEW_IN_311 = {
    "typing": {"Self", "Unpack", "Never", "LiteralString", "assert_never", "reveal_type",
               "TypeVarTuple", "Required", "NotRequired", "dataclass_transform"},
    "enum": {"StrEnum", "ReprEnum", "verify", "member", "nonmember"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner"},
    "datetime": {"UTC"},
}
MODULES_311 = {"tomllib", "wsgiref.types"}


def _files() -> list[Path]:
    out: list[Path] = []
    for name in CLIENT_SIDE:
        path = SRC / name
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
    return out


def test_client_side_code_needs_nothing_from_python_311():
    found = []
    for path in _files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module in NEW_IN_311:
                bad = {a.name for a in node.names} & NEW_IN_311[node.module]
                found += [f"{where}: from {node.module} import {b}" for b in sorted(bad)]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [
                    a.name for a in node.names]
                found += [f"{where}: import {n}" for n in names if n in MODULES_311]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                    node.attr in NEW_IN_311.get(node.value.id, ())):
                found += [f"{where}: {node.value.id}.{node.attr}"]
            elif type(node).__name__ == "TryStar":
                found.append(f"{where}: except*")
    assert len(_files()) > 50
    assert not found, "Python 3.11+ only, in code the SDK runs on 3.10:\n" + "\n".join(found)
