"""MkDocs hooks (mkdocs.yml ``hooks:``): the docstrings are written for Sphinx-style
readers (``:meth:`create```, ``:class:`~corral.errors.InvalidArgument```, ``::`` before
an example); on the API reference page, show them as plain code."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:meth|class|func|attr|mod|data|exc|obj|ref):(<code>)")
_TILDE = re.compile(r"<code>~(?:[\w]+\.)*([\w]+)</code>")
_LITERAL = re.compile(r"::</p>")


def on_page_content(html: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "reference.md":
        return html
    html = _TILDE.sub(r"<code>\1</code>", _ROLE.sub(r"\1", html))
    return _LITERAL.sub(":</p>", html)
