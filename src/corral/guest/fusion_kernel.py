"""The cell runner of SandboxFusion's ``/run_jupyter``, run *inside* the sandbox.

Not imported by the daemon: :mod:`corral.server.compat.sandboxfusion` copies this file into the sandbox
and runs it with ``python3 KERNEL REQUEST``, where the file ``REQUEST`` holds
``{"cells", "cell_timeout", "result"}``. Like a Jupyter ``python3`` kernel, the cells share one namespace, run in
order whatever failed before, and the value of a cell's last expression is its
``display`` (``{"text/plain": repr(value)}``); an exception is its ``error``
(``ename``, ``evalue``, ``traceback``). Each cell's output is captured at the file
descriptors, so a subprocess's output counts too. The results go to the file named
``result``, read by the daemon, which checks them (this process runs the cells' code).
"""

import ast
import json
import os
import signal
import sys
import tempfile
import traceback

MAX_STREAM = 1 << 20  # bytes kept of a cell's stdout, and of its stderr


class CellTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CellTimeout("the cell ran longer than cell_timeout")


def _read(f):
    f.seek(0)
    return f.read(MAX_STREAM).decode("utf-8", "replace")


def run_cell(source, namespace, timeout):
    result = {"stdout": "", "stderr": "", "display": [], "error": []}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            if timeout > 0:
                signal.setitimer(signal.ITIMER_REAL, timeout)
            tree = ast.parse(source, "<cell>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell>", "exec"), namespace)
            if last is not None:
                value = eval(compile(last, "<cell>", "eval"), namespace)
                if value is not None:
                    namespace["_"] = value
                    result["display"].append({"text/plain": repr(value)})
        except BaseException as exc:  # SystemExit too: a cell never ends the kernel
            result["error"].append({
                "ename": type(exc).__name__,
                "evalue": str(exc),
                "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__),
            })
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        result["stdout"], result["stderr"] = _read(out), _read(err)
    return result


def main():
    with open(sys.argv[1]) as f:
        request = json.load(f)
    signal.signal(signal.SIGALRM, _alarm)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    cells = [run_cell(c, namespace, request["cell_timeout"]) for c in request["cells"]]
    with open(request["result"], "w") as f:
        json.dump({"cells": cells}, f)


if __name__ == "__main__":
    main()
