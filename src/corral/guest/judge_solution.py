"""The solution's side of the Python judge (:mod:`corral.guest.judge`): the process
that loads the solution and answers the judge's requests over a pipe.

Forked by the judge before the tests exist; whatever runs here is the solution's to
control (it may patch this very code), so nothing here decides a verdict: it answers
with plain data (:mod:`corral.guest.judge_wire`) that the judge decodes strictly.
"""

import os
import signal
import sys
import types

if "encode" not in globals():  # on the host (tests, lint); in the sandbox, wire precedes
    from corral.guest.judge_wire import SolutionGone, decode, encode, recv, send

MAX_ITEMS = 1_000_000           # items of an iterated handle


def solution_main(rfd, wfd):
    """The solution's side: load the code, then answer calls until EOF."""
    objects, ids = [], {}

    def ref(obj):
        key = id(obj)
        if key not in ids:
            ids[key] = len(objects)
            objects.append(obj)
        return ids[key]

    def lookup(i):
        if not 0 <= i < len(objects):
            raise ValueError("no such object")
        return objects[i]

    class Alarm(BaseException):
        pass

    def on_alarm(signum, frame):
        raise Alarm()

    signal.signal(signal.SIGALRM, on_alarm)
    module = None
    while True:
        try:
            msg = recv(rfd)
        except SolutionGone:
            os._exit(0)
        op = msg.get("op")
        streams = _Streams(msg.get("stdin"))
        try:
            limit = msg.get("timeout")
            signal.setitimer(signal.ITIMER_REAL, max(0.001, limit) if limit else 0)
            try:
                if op == "load":
                    module = _new_module(msg)
                    _load(module, msg)
                    reply = {}
                elif op == "resolve":
                    names = module.__dict__ if module is not None else {}
                    reply = {"values": {n: encode(names[n], ref) for n in msg["names"] if n in names},
                             "defined": [n for n in msg.get("probe", ()) if n in names]}
                elif op == "setattr":
                    target = module if msg["ref"] is None else lookup(msg["ref"])
                    if "value" in msg:
                        setattr(target, msg["name"], decode(msg["value"], lookup))
                    else:
                        delattr(target, msg["name"])
                    reply = {}
                else:
                    reply = _answer(op, lookup(msg["ref"]), msg, ref, lookup)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Alarm:
            reply = {"timeout": True}
        except BaseException as exc:
            reply = {"raise": _describe(exc)}
        reply.update(streams.restore())
        reply["seq"] = msg.get("seq")
        try:
            send(wfd, reply)
        except (ValueError, RecursionError) as exc:
            send(wfd, {"raise": _describe(exc), "seq": msg.get("seq")})


def _answer(op, obj, msg, ref, lookup):
    if op == "call":
        args = [decode(a, lookup) for a in msg["args"]]
        kwargs = {k: decode(v, lookup) for k, v in msg["kwargs"].items()}
        value = obj(*args, **kwargs)
        # In-place changes of list/dict/set arguments travel back (sort_in_place(xs)).
        return {"value": encode(value, ref),
                "after": [encode(a, ref) if type(a) in (list, dict, set) else None for a in args],
                "after_kw": {k: encode(v, ref) for k, v in kwargs.items()
                             if type(v) in (list, dict, set)}}
    if op == "getattr":
        return {"value": encode(getattr(obj, msg["name"]), ref)}
    if op == "next":
        return {"value": encode(next(obj), ref)}
    if op == "iter":
        items = []
        for item in obj:
            if len(items) >= MAX_ITEMS:
                raise ValueError("more than %d items" % MAX_ITEMS)
            items.append(item)
        return {"value": encode(items, ref)}
    if op == "len":
        return {"value": encode(len(obj), ref)}
    if op == "state":
        return {"value": encode(_state(obj), ref), "cls": ref(type(obj))}
    raise ValueError("unknown op %r" % (op,))


def _state(obj):
    """What an object of the solution's own class holds (``vars`` and slots), for a
    test that compares two of them; ``None`` for an object without state (a function):
    then only identity makes two equal."""
    d = getattr(obj, "__dict__", None)
    state = dict(d) if isinstance(d, dict) else None
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                state = {} if state is None else state
                state[slot] = getattr(obj, slot)
    return state


class _Streams:
    """The solution's ``sys.stdin``/``stdout``/``stderr`` for one request: what the test
    feeds (``sys.stdin = io.StringIO(...)`` on its side) comes in, what the solution
    prints goes back, so a test's ``redirect_stdout`` sees it."""

    LIMIT = 8 << 20

    def __init__(self, stdin):
        import io

        self.saved = (sys.stdin, sys.stdout, sys.stderr)
        self.fed = stdin if type(stdin) is str else None
        if self.fed is not None:
            sys.stdin = io.TextIOWrapper(io.BytesIO(self.fed.encode()), encoding="utf-8")
        self.stdin = sys.stdin
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        self.out, self.err = sys.stdout, sys.stderr

    def restore(self):
        reply = {"out": self.out.getvalue()[:self.LIMIT], "err": self.err.getvalue()[:self.LIMIT]}
        if self.fed is not None:
            try:
                reply["stdin_left"] = len(self.stdin.read())
            except Exception:  # noqa: BLE001 - closed or replaced: all of it was used
                reply["stdin_left"] = 0
        sys.stdin, sys.stdout, sys.stderr = self.saved
        return reply


def _new_module(msg):
    name = msg["module"]
    module = types.ModuleType(name)
    module.__file__ = os.path.abspath(msg["filename"])
    sys.modules[name] = module
    sys.path.insert(0, os.path.dirname(module.__file__))
    return module


def _load(module, msg):
    code, filename = msg.get("code"), msg["filename"]
    if code is None:
        with open(filename, encoding="utf-8", errors="replace") as f:
            code = f.read()
    try:
        exec(compile(code, filename, "exec"), module.__dict__)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise  # a clean exit at the top level keeps what was defined before it


def _describe(exc):
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        message = str(exc)[:2000]
    except BaseException:
        message = "?"
    mro = [c.__name__ for c in type(exc).__mro__]
    return {"type": type(exc).__name__, "mro": mro[:32], "message": message,
            "traceback": tb[-4000:]}
