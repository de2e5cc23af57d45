"""The documentation site: every page of docs/ is in mkdocs.yml's nav, the README's links
land on a file and a heading that exist, and the site builds with ``mkdocs build
--strict`` (which refuses a page left out of the nav, a broken link or anchor, and a
README section that docs/ includes but that is gone). The blocks of the pages are
run or checked by tests/test_readme.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == on_disk
    assert len(set(nav)) == len(nav), "a page is in the nav twice"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading (and MkDocs, for these headings)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_links_land():
    links = re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", (ROOT / "README.md").read_text())
    assert len(links) > 20
    for target, anchor in links:
        if target.startswith(("http://", "https://")):
            continue
        path = ROOT / (target or "README.md")
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor[1:] in _anchors(path), f"README links to {target}{anchor}: no such heading"


def test_the_site_builds_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None
               or importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)}): "
                    "pip install -e '.[docs]'")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    assert built >= {p.stem for p in DOCS.glob("*.md") if p.stem != "index"}
    home = (tmp_path / "site" / "index.html").read_text()
    assert "exec_stream" in home and "--8&lt;--" not in home  # the README's SDK, included
