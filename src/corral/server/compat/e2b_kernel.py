"""The Python kernel behind E2B's Code Interpreter: runs *inside* a sandbox, one
process per code context, started by :mod:`.e2b_interpreter` (``python3 -u -c SRC``).

Protocol, one JSON object per line: the daemon writes ``{"code", "env", "id"}`` on
its stdin; it answers on the descriptor its stdout was at start (the code's own
stdout and stderr, its subprocesses' too, go through pipes and come back as
``{"type": "stdout"|"stderr", "text"}``), then a ``result`` per open matplotlib figure
(``png``: base64, then closed) and one for the last expression (``text``: its
``repr``, Jupyter-style; ``html`` too if it has ``_repr_html_``, e.g. a pandas
DataFrame; ``png`` if it is a figure), or ``error`` (``name``, ``value``,
``traceback``), and last ``{"type": "end", "id"}``. State (the globals) is kept between executions.
This file uses the standard library only. The daemon trusts none of it: every
line is validated and bounded there.
"""

import ast
import base64
import io
import json
import os
import sys
import threading
import traceback

CHUNK = 65536


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

    def figures(value):
        """A result for each figure the cell left open (the value's own: in the main
        result); all are closed, like Jupyter's inline backend."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            if fig is not value:
                send({"type": "result", "png": png(fig), "text": repr(fig),
                      "is_main_result": False})
        plt.close("all")

    def main_result(value):
        msg = {"type": "result", "text": repr(value), "is_main_result": True}
        html = getattr(type(value), "_repr_html_", None)
        if html is not None:
            try:
                out = html(value)
                if isinstance(out, str):
                    msg["html"] = out
            except Exception:  # noqa: BLE001 - a display method's failure is not the cell's
                pass
        if callable(getattr(value, "savefig", None)) and hasattr(value, "get_axes"):
            msg["png"] = png(value)  # a matplotlib Figure
        return msg

    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            code, env, ident = req["code"], req.get("env") or {}, req.get("id")
        except (ValueError, KeyError, TypeError):
            continue
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update({str(k): str(v) for k, v in env.items()})
        try:
            tree = ast.parse(code, "<cell>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell>", "exec"), scope)
            value = eval(compile(last, "<cell>", "eval"), scope) if last is not None else None
            flush()
            figures(value)
            if value is not None:
                send(main_result(value))
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
