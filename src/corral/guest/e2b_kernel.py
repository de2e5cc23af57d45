"""The Python kernel behind E2B's Code Interpreter: runs *inside* a sandbox, one
process per code context, started by :mod:`corral.server.compat.e2b_interpreter` (``python3 -u -c SRC``).

Protocol, one JSON object per line: the daemon writes ``{"code", "env", "id"}`` on
its stdin; it answers on the descriptor its stdout was at start (the code's own
stdout and stderr, its subprocesses' too, go through pipes and come back as
``{"type": "stdout"|"stderr", "text"}``), then a ``result`` per open matplotlib figure
(``png``: base64, and ``chart``: e2b's structured chart of it, then closed), one per
``display(obj)`` call and one for the last expression: ``text`` (its ``repr``,
Jupyter-style) and every format its ``_repr_mimebundle_`` / ``_repr_*_`` methods give
(``html``, ``markdown``, ``svg``, ``png``, ``jpeg``, ``pdf`` (binary ones base64),
``latex``, ``json``, ``javascript``; other MIME types of a bundle in ``extra``); or
``error`` (``name``, ``value``, ``traceback``), and last ``{"type": "end", "id"}``.
State (the globals) is kept between executions. A cell that is not Python because
of IPython's shell lines (``!pip install x``, ``!ls``) runs each such line through
``/bin/sh -c``, its output streamed like the cell's own (as in Jupyter).
This file uses the standard library only. The daemon trusts none of it: every
line is validated and bounded there.
"""

import ast
import base64
import io
import json
import math
import os
import re
import sys
import threading
import traceback

CHUNK = 65536
MAX_MESSAGE = (4 << 20) - 4096  # a result line past this loses its largest formats
MAX_POINTS = 10000  # of one chart element (a line's points, a scatter's)
MAX_ELEMENTS = 1000  # of one chart
REPRS = (("html", "_repr_html_"), ("markdown", "_repr_markdown_"), ("svg", "_repr_svg_"),
         ("png", "_repr_png_"), ("jpeg", "_repr_jpeg_"), ("pdf", "_repr_pdf_"),
         ("latex", "_repr_latex_"), ("json", "_repr_json_"),
         ("javascript", "_repr_javascript_"))
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
        "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
        "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
        "application/javascript": "javascript", "e2b/chart": "chart"}
BINARY = ("png", "jpeg", "pdf")
UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")


def _value(v):
    """A chart coordinate as JSON: a finite float, else text (dates: ISO 8601)."""
    if hasattr(v, "isoformat"):
        return v.isoformat()
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if type(v).__name__.startswith("datetime64"):
        return str(v)
    return f if math.isfinite(f) else None


def _scale(ax, axis):
    conv = getattr(axis, "get_converter", lambda: getattr(axis, "converter", None))()
    name = type(conv).__name__ if conv is not None else ""
    if "Date" in name:
        return "datetime"
    if "Category" in name:
        return "categorical"
    return (ax.get_xscale if axis is ax.xaxis else ax.get_yscale)()


def _axis(ax, axis, which):
    label = axis.get_label_text() or None
    found = UNIT.search(label or "")
    unit = (found.group(1) or found.group(2)) if found else None
    scale = _scale(ax, axis)
    ticks = list(axis.get_ticklocs())
    if scale == "datetime":
        import matplotlib.dates as mdates
        ticks = [mdates.num2date(t).isoformat() for t in ticks]
    else:
        ticks = [_value(t) for t in ticks]
    return {f"{which}_label": label, f"{which}_unit": unit, f"{which}_scale": scale,
            f"{which}_ticks": [t for t in ticks if t is not None],
            f"{which}_tick_labels": [t.get_text() for t in axis.get_ticklabels()]}


def _points(xs, ys):
    out = []
    for x, y in zip(xs, ys):  # noqa: B905 - any python3 runs this (no strict=)
        x, y = _value(x), _value(y)
        if x is not None and y is not None:
            out.append([x, y])
        if len(out) >= MAX_POINTS:
            break
    return out


def _axes_chart(ax):
    """e2b's chart of one matplotlib Axes: pie, bar, line or scatter; else ``unknown``
    (its title only)."""
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    title = ax.get_title() or None
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        return {"type": "pie", "title": title, "elements": [
            {"label": w.get_label(), "angle": abs(w.theta2 - w.theta1), "radius": w.r}
            for w in wedges[:MAX_ELEMENTS]]}
    two_d = {**_axis(ax, ax.xaxis, "x"), **_axis(ax, ax.yaxis, "y")}
    axes_fields = ("x_label", "y_label", "x_unit", "y_unit")
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        elements = []
        for i, c in enumerate(bars):
            group = c.get_label()
            if not group or group.startswith("_"):
                group = f"Group {i}"
            flat = getattr(c, "orientation", "vertical") == "horizontal"
            axis = ax.yaxis if flat else ax.xaxis
            names = {round(float(loc), 6): t.get_text()
                     for loc, t in zip(axis.get_ticklocs(), axis.get_ticklabels())}  # noqa: B905
            for r in c.patches:
                where = r.get_y() + r.get_height() / 2 if flat else r.get_x() + r.get_width() / 2
                label = names.get(round(where, 6)) or f"{where:g}"
                value = _value(r.get_width() if flat else r.get_height())
                elements.append({"label": label, "group": group, "value": value})
        return {"type": "bar", "title": title, **{k: two_d[k] for k in axes_fields},
                "elements": elements[:MAX_ELEMENTS]}
    lines = ax.get_lines()
    dots = [c for c in ax.collections if isinstance(c, PathCollection)]
    if lines:
        kind = "line"
        elements = [{"label": ln.get_label(), "points": _points(ln.get_xdata(), ln.get_ydata())}
                    for ln in lines[:MAX_ELEMENTS]]
    elif dots:
        kind = "scatter"
        elements = []
        for c in dots[:MAX_ELEMENTS]:
            xy = c.get_offsets()
            xy = xy.filled(math.nan) if hasattr(xy, "filled") else xy  # masked: NaN
            elements.append({"label": c.get_label(),
                             "points": _points([p[0] for p in xy], [p[1] for p in xy])})
    else:
        return {"type": "unknown", "title": title, "elements": []}
    return {"type": kind, "title": title, **two_d, "elements": elements}


def chart(fig):
    """e2b's chart of a matplotlib Figure: its one Axes' chart, a ``superchart`` of
    several (titled by the figure's suptitle), or None."""
    axes = [ax for ax in fig.get_axes() if ax.get_visible()][:MAX_ELEMENTS]
    if not axes:
        return None
    if len(axes) == 1:
        return _axes_chart(axes[0])
    sup = getattr(fig, "_suptitle", None)
    return {"type": "superchart", "title": sup.get_text() if sup is not None else None,
            "elements": [_axes_chart(ax) for ax in axes]}


def _put(msg, key, data):
    """Format ``key`` of a result from what a display method returned (IPython's
    conventions: a ``(data, metadata)`` pair, binary data as bytes or base64 text)."""
    if isinstance(data, tuple) and len(data) == 2:
        data = data[0]
    if data is None or key in msg and key != "text":
        return
    if key in BINARY and isinstance(data, (bytes, bytearray)):
        data = base64.b64encode(bytes(data)).decode("ascii")
    if key in ("json", "chart"):
        if not isinstance(data, (dict, list)) or not _jsonable(data):
            return
    elif not isinstance(data, str):
        return
    msg[key] = data


def _jsonable(data):
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _call(value, name, *args):
    method = getattr(type(value), name, None)
    if method is None or isinstance(value, type):
        return None
    try:
        return method(value, *args)
    except Exception:  # noqa: BLE001 - a display method's failure is not the cell's
        return None


def _fit(msg):
    """The result as one line, its largest formats left out while it is too long."""
    line = json.dumps(msg)
    while len(line) > MAX_MESSAGE:
        extra = {k: v for k, v in msg.items() if k not in ("type", "text", "is_main_result")}
        if not extra:
            msg["text"] = msg["text"][: MAX_MESSAGE // 8]
            return json.dumps(msg)
        del msg[max(extra, key=lambda k: len(json.dumps(extra[k])))]
        line = json.dumps(msg)
    return line


SHELL_LINE = re.compile(r"^([ \t]*)!(.*)$")


def shell(command):
    """A cell's ``!command`` line: run by /bin/sh on the cell's stdout and stderr."""
    import subprocess

    sys.stdout.flush()
    sys.stderr.flush()
    subprocess.run(command, shell=True, stdin=subprocess.DEVNULL)


def parse_cell(code):
    """The cell's syntax tree; IPython's ``!command`` lines (never Python outside a
    string, so only tried once the cell does not parse) become ``shell()`` calls."""
    try:
        return ast.parse(code, "<cell>", "exec")
    except SyntaxError:
        lines = code.split("\n")
        changed = [SHELL_LINE.sub(lambda m: m.group(1) + "__corral_shell__(" + repr(m.group(2))
                                  + ")", line) if SHELL_LINE.match(line) else line
                   for line in lines]
        if changed == lines:
            raise
        return ast.parse("\n".join(changed), "<cell>", "exec")


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    lock = threading.Lock()

    def send(msg):
        with lock:
            proto.write(json.dumps(msg) + "\n")
            proto.flush()

    pipes = {}
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        pipes[kind] = r
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    drained = {k: threading.Event() for k in pipes}

    def pump(kind, r):
        while True:
            data = os.read(r, CHUNK)
            if not data:
                return
            if data == b"\0":  # the marker flush() wrote: all before it is sent
                drained[kind].set()
                continue
            marker = data.endswith(b"\0")
            text = data[:-1] if marker else data
            if text:
                send({"type": kind, "text": text.decode("utf-8", "replace")})
            if marker:
                drained[kind].set()

    for kind, r in pipes.items():
        threading.Thread(target=pump, args=(kind, r), daemon=True).start()

    def flush():
        sys.stdout.flush()
        sys.stderr.flush()
        for kind, fd in (("stdout", 1), ("stderr", 2)):
            drained[kind].clear()
            os.write(fd, b"\0")
            drained[kind].wait(10)

    def png(fig):
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def is_figure(value):
        return callable(getattr(value, "savefig", None)) and hasattr(value, "get_axes")

    def result(value, main):
        """The result message of ``value``: its text and every format it displays as."""
        msg = {"type": "result", "text": repr(value), "is_main_result": main}
        bundle = _call(value, "_repr_mimebundle_", None, None)
        if isinstance(bundle, tuple) and len(bundle) == 2:
            bundle = bundle[0]
        if isinstance(bundle, dict):
            for mime, data in bundle.items():
                if mime in MIME:
                    _put(msg, MIME[mime], data)
                elif isinstance(mime, str) and _jsonable(data):
                    msg.setdefault("extra", {})[mime] = data
        for key, name in REPRS:
            if key not in msg:
                _put(msg, key, _call(value, name))
        if is_figure(value):  # a matplotlib Figure
            msg["png"] = png(value)
            try:
                _put(msg, "chart", chart(value))
            except Exception:  # noqa: BLE001 - a figure it cannot read is still a png
                pass
        with lock:
            proto.write(_fit(msg) + "\n")
            proto.flush()

    def figures(value):
        """A result for each figure the cell left open (the value's own: in the main
        result); all are closed, like Jupyter's inline backend."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            if fig is not value:
                result(fig, False)
        plt.close("all")

    def display(*objs, **_):
        """IPython's ``display``: a result per object, not the cell's main one."""
        flush()
        for obj in objs:
            result(obj, False)

    import builtins
    builtins.display = display
    scope = {"__name__": "__main__", "__builtins__": __builtins__,
             "__corral_shell__": shell}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            code, env, ident = req["code"], req.get("env") or {}, req.get("id")
        except (ValueError, KeyError, TypeError):
            continue
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update({str(k): str(v) for k, v in env.items()})
        try:
            tree = parse_cell(code)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell>", "exec"), scope)
            value = eval(compile(last, "<cell>", "eval"), scope) if last is not None else None
            flush()
            figures(value)
            if value is not None:
                result(value, True)
        except BaseException as exc:  # noqa: B036 - a cell's KeyboardInterrupt/SystemExit too
            flush()
            tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
            send({"type": "error", "name": type(exc).__name__, "value": str(exc),
                  "traceback": "".join(tb)})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        send({"type": "end", "id": ident})


if __name__ == "__main__":
    main()
