"""The layers hold: contracts in pyproject.toml ([tool.importlinter]), and no module
imports another that imports it back (scripts/import_cycles.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_layer_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_import_circles():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_cycles.py")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, "import circles:\n" + proc.stdout


def test_the_circle_finder_finds_a_circle():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_cycles
    finally:
        sys.path.pop(0)
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles.circles(edges) == [["a", "b", "c"]]
    assert import_cycles.circles({"a": {"b"}, "b": set()}) == []


def test_a_type_only_import_counts_as_an_edge(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_cycles
    finally:
        sys.path.pop(0)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    monkeypatch.setattr(import_cycles, "SRC", tmp_path)
    assert import_cycles.circles(import_cycles.graph()) == [["pkg.a", "pkg.b"]]
