"""What one Code Interpreter ``result`` may carry, as the daemon passes it on.

The kernel (:mod:`corral.guest.e2b_kernel`) runs in the same process as the code being judged, so
a cell can write any line to the protocol channel; each ``result`` it writes is
rebuilt here from checked fields only, in the shape ``e2b-code-interpreter``'s
``Result`` parses:

- ``text`` (cut to :data:`MAX_TEXT` characters) and ``is_main_result``;
- ``html``, ``markdown``, ``svg``, ``latex``, ``javascript``: text of at most
  :data:`MAX_TEXT` characters, else left out;
- ``png``, ``jpeg``, ``pdf``: valid base64 of at most :data:`MAX_BINARY` characters;
- ``json``: an object or array; ``extra``: an object of at most :data:`MAX_EXTRA`
  MIME types; both JSON without NaN or infinities;
- ``chart``: e2b's chart, every field the client reads present and of its type
  (:func:`chart`), else left out, so the client's parser never fails on it.

The line itself is bounded before it gets here (its length, its JSON's depth and
item count), and :class:`Budget` bounds what one execution passes on.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_TEXT = 1 << 20  # characters of a text format
MAX_BINARY = 4 << 20  # characters of a base64 format
MAX_EXTRA = 32  # MIME types in ``extra``
MAX_LABEL = 4096  # characters of a chart's label, title, unit, tick label or value
MAX_RESULTS = 1000  # results of one execution passed on; later ones are dropped
MAX_RESULT_BYTES = 64 << 20  # results' bytes of one execution with all their formats
TEXTS = ("html", "markdown", "svg", "latex", "javascript")
BINARY = ("png", "jpeg", "pdf")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
CHARTS_2D = ("line", "scatter", "bar", "box_and_whisker")
BOX_FIELDS = ("min", "first_quartile", "median", "third_quartile", "max")


class Invalid(Exception):
    """A chart field the client could not parse."""


def _finite(value: Any) -> bool:
    """JSON without NaN or infinities (the line's depth is bounded already)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _text(value: Any, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_LABEL:
        raise Invalid
    return value


def _number(value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid
    if isinstance(value, float) and not math.isfinite(value):
        raise Invalid
    return value


def _scalar(value: Any) -> str | float | int | None:
    """A coordinate or tick: a number or text."""
    return _text(value) if isinstance(value, str) else _number(value)


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise Invalid
    return value


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid
    return value


def _points(value: Any) -> list[list[Any]]:
    out = []
    for point in _list(value):
        if not isinstance(point, list) or len(point) != 2:
            raise Invalid
        out.append([_scalar(point[0]), _scalar(point[1])])
    return out


def _element(kind: str, raw: Any) -> dict[str, Any]:
    e = _dict(raw)
    label = _text(e.get("label"))
    if kind in ("line", "scatter"):
        return {"label": label, "points": _points(e.get("points"))}
    if kind == "bar":
        return {"label": label, "group": _text(e.get("group")), "value": _scalar(e.get("value"))}
    if kind == "pie":
        return {"label": label, "angle": _number(e.get("angle")),
                "radius": _number(e.get("radius"))}
    box: dict[str, Any] = {"label": label, **{k: _number(e.get(k)) for k in BOX_FIELDS}}
    box["outliers"] = [_number(v) for v in _list(e.get("outliers", []))]
    return box


def _chart(raw: Any, nested: bool) -> dict[str, Any]:
    c = _dict(raw)
    kind = c.get("type")
    if kind not in (*CHARTS_2D, "pie", "superchart", "unknown") or (
            nested and kind == "superchart"):
        raise Invalid
    out: dict[str, Any] = {"type": kind, "title": _text(c.get("title"), optional=True)}
    elements = _list(c.get("elements"))
    if kind in CHARTS_2D:
        for key in ("x_label", "y_label", "x_unit", "y_unit"):
            out[key] = _text(c.get(key), optional=True)
    if kind in ("line", "scatter"):
        for axis in ("x", "y"):
            out[f"{axis}_scale"] = _text(c.get(f"{axis}_scale"), optional=True)
            out[f"{axis}_ticks"] = [_scalar(t) for t in _list(c.get(f"{axis}_ticks"))]
            out[f"{axis}_tick_labels"] = [_text(t) for t in _list(c.get(f"{axis}_tick_labels"))]
    if kind == "superchart":
        out["elements"] = [_chart(e, True) for e in elements]
    elif kind == "unknown":
        out["elements"] = []
    else:
        out["elements"] = [_element(kind, e) for e in elements]
    return out


def chart(raw: Any) -> dict[str, Any] | None:
    """``raw`` rebuilt as e2b's chart (line, scatter, bar, pie, box and whisker, a
    superchart of those, or ``unknown`` with no elements), or None if any field the
    client reads is missing or of the wrong type."""
    try:
        return _chart(raw, False)
    except Invalid:
        return None


def result(msg: dict[str, Any]) -> dict[str, Any]:
    """The ``result`` message ``msg`` with only its checked formats."""
    clean: dict[str, Any] = {"type": "result"}
    if isinstance(msg.get("text"), str):
        clean["text"] = msg["text"][:MAX_TEXT]
    for key in TEXTS:
        value = msg.get(key)
        if isinstance(value, str) and len(value) <= MAX_TEXT:
            clean[key] = value
    for key in BINARY:
        value = msg.get(key)
        if (isinstance(value, str) and len(value) <= MAX_BINARY and len(value) % 4 == 0
                and _BASE64.fullmatch(value)):
            clean[key] = value
    data = msg.get("json")
    if isinstance(data, (dict, list)) and _finite(data):
        clean["json"] = data
    extra = msg.get("extra")
    if (isinstance(extra, dict) and 0 < len(extra) <= MAX_EXTRA and _finite(extra)
            and all(len(k) <= MAX_LABEL for k in extra)):
        clean["extra"] = extra
    drawn = chart(msg.get("chart")) if msg.get("chart") is not None else None
    if drawn is not None:
        clean["chart"] = drawn
    clean["is_main_result"] = msg.get("is_main_result") is not False
    return clean


class Budget:
    """What one execution may pass on in results: :data:`MAX_RESULTS` of them and
    :data:`MAX_RESULT_BYTES` with their formats; past that, results keep only their
    ``text``, and past the count they are dropped."""

    def __init__(self) -> None:
        self.count = 0
        self.size = 0
        self.cut = False
        self.noted = False

    def admit(self, msg: dict[str, Any], size: int) -> dict[str, Any] | None:
        """``msg`` as it may be passed on (``size``: its encoded length), or None."""
        self.count += 1
        if self.count > MAX_RESULTS:
            self.cut = True
            return None
        if self.size + size > MAX_RESULT_BYTES:
            self.cut = True
            slim = {k: msg[k] for k in ("type", "text", "is_main_result") if k in msg}
            self.size += len(slim.get("text", ""))
            return slim
        self.size += size
        return msg

    def note(self) -> str | None:
        """Once, the stderr line that says results were cut, if they were."""
        if self.noted or not self.cut:
            return None
        self.noted = True
        return (f"corral: this execution's results passed {MAX_RESULTS} results or "
                f"{MAX_RESULT_BYTES >> 20} MiB; later ones were cut to their text or "
                "dropped\n")
