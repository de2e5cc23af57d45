"""The test judge: runs inside the sandbox as ``python3 -I -c <wire + this file>``.

Not imported by corral on the host (but by its tests); :mod:`corral.rl._grading` sends
the text of :mod:`corral.rl._judge_wire` and of this file as the command. The design,
and why a solution cannot forge its verdict, is in docs/grading.md:

- The judge makes itself non-dumpable (no ``/proc/PID/mem``, ``/proc/PID/fd``,
  ``pidfd_getfd`` for anything of the same uid), kills any other process of the sandbox
  (the host already swept them), forks the *solution process*, and only then prints
  ``READY``; the host answers with one line, the request. So the tests never reach the
  solution's memory, disk, argv or environment.
- The solution process loads the code and answers remote calls over a pipe. The judge
  runs each test itself: every name the test uses that the solution defines is looked
  up there — plain values come back as values, anything else as a :class:`Ref` handle;
  calling a handle sends the arguments (plain data) and brings back the return value
  through the strict decoder of :mod:`corral.rl._judge_wire`. A handle can be called,
  have attributes read, be iterated and measured, but never compared, hashed or tested
  for truth: an object whose ``__eq__`` always answers True does not exist here.
- The verdict goes to the judge's own stdout, which nothing else holds.

A test that passes an object *it defined itself* (a lambda, an instance of its own
class) to the solution cannot be judged this way: it is reported ``unsplittable`` and
the host decides (``grading="auto"`` runs it in the solution's process, flagged).
"""

import builtins
import json
import os
import signal
import sys
import time
import types

if "encode" not in globals():  # on the host (tests, lint); in the sandbox, wire precedes
    from corral.rl._judge_wire import (
        MAX_DEPTH,
        Handle,
        JudgeTimeout,
        SolutionGone,
        decode,
        encode,
        recv,
        send,
    )

# Imported only where needed (traceback on an error, ctypes in the judge): every
# millisecond of start-up is paid once per graded solution.

READY = "corral-judge-ready"
MAX_ITEMS = 1_000_000           # items of an iterated handle
TEST_MODULE = "__corral_test__"  # the tests' __name__


class NotPlainData(BaseException):
    """A handle was compared, hashed or tested for truth, or the test tried to pass the
    solution something that came from it and is not plain data."""


class CandidateError(Exception):
    """An exception of the solution that is not a built-in exception type."""


class Unsplittable(BaseException):
    """A test passed an object of its own that is not plain data to the solution."""


# ------------------------------------------------------------- solution process


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
                    reply = {"values": {n: encode(names[n], ref) for n in msg["names"] if n in names}}
                else:
                    reply = _answer(op, lookup(msg["ref"]), msg, ref, lookup)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Alarm:
            reply = {"timeout": True}
        except BaseException as exc:
            reply = {"raise": _describe(exc)}
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
    raise ValueError("unknown op %r" % (op,))


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


# ------------------------------------------------------------------- the judge


class Ref(Handle):
    """A handle to an object that lives in the solution's process."""

    __slots__ = ()

    def __init__(self, i):
        object.__setattr__(self, "_id", i)

    def __call__(self, *args, **kwargs):
        enc_args = [_send_arg(a) for a in args]
        enc_kwargs = {k: _send_arg(v) for k, v in kwargs.items()}
        reply = JUDGE.rpc({"op": "call", "ref": self._id, "args": enc_args, "kwargs": enc_kwargs})
        afters, after_kw = reply.get("after"), reply.get("after_kw")
        for arg, after in zip(args, afters if type(afters) is list else [], strict=False):
            if after is not None:
                _update_in_place(arg, JUDGE.decode(after))
        for key, after in (after_kw.items() if type(after_kw) is dict else ()):
            if key in kwargs:
                _update_in_place(kwargs[key], JUDGE.decode(after))
        return JUDGE.value(reply)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return JUDGE.value(JUDGE.rpc({"op": "getattr", "ref": self._id, "name": name}))

    def __iter__(self):
        return iter(JUDGE.value(JUDGE.rpc({"op": "iter", "ref": self._id})))

    def __next__(self):
        reply = JUDGE.rpc({"op": "next", "ref": self._id})
        return JUDGE.value(reply)

    def __len__(self):
        n = JUDGE.value(JUDGE.rpc({"op": "len", "ref": self._id}))
        if type(n) is not int:
            raise TypeError("len() of the solution's object is not an int")
        return n

    def _refuse(self, *args):
        raise NotPlainData(
            "the solution returned an object that is not plain data (%r); a test can only "
            "compare None, bool, int, float, complex, str, bytes, list, tuple, dict, set"
            % (self,))

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = _refuse
    __contains__ = __index__ = __int__ = __float__ = __str__ = _refuse

    def __repr__(self):
        return "<object #%d of the solution>" % self._id


def _send_arg(value):
    """``value`` encoded for the solution. A test becomes unsplittable only by passing
    something of its own (a lambda, a built-in, an instance of its class); what came
    from the solution (a rebuilt exception, its data nested deeper) fails the test
    instead, so a solution cannot push a test into in-process grading by its answers."""
    try:
        return encode(value)
    except TypeError as exc:
        if _holds_solution_object(value, 0):
            raise NotPlainData("cannot pass the solution's own objects back: %s" % exc) from None
        raise Unsplittable("an argument is not plain data (%s)" % exc) from None
    except (ValueError, RecursionError) as exc:
        raise NotPlainData("cannot pass this to the solution: %s" % exc) from None


def _holds_solution_object(value, depth):
    if depth > 2 * MAX_DEPTH:
        return True
    if getattr(value, "_corral_from_solution", False) is True:
        return True
    t = type(value)
    if t in (list, tuple, set, frozenset):
        return any(_holds_solution_object(v, depth + 1) for v in value)
    if t is dict:
        return any(_holds_solution_object(k, depth + 1) or _holds_solution_object(v, depth + 1)
                   for k, v in value.items())
    return False


def _update_in_place(arg, new):
    """Carry a call's change of a mutable argument back to the test's object."""
    if type(arg) is list and type(new) is list:
        arg[:] = new
    elif type(arg) in (dict, set) and type(new) is type(arg):
        arg.clear()
        arg.update(new)


class SolutionModule(types.ModuleType):
    """``import solution`` / ``from solution import f`` in a test."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        values = JUDGE.resolve([name])
        if name not in values:
            raise AttributeError("the solution defines no %r" % name)
        return values[name]


class Judge:
    def __init__(self, rfd, wfd, pid):
        self.rfd, self.wfd, self.pid = rfd, wfd, pid
        self.deadline = None
        self.gone = None
        self.seq = 0

    def rpc(self, msg):
        if self.gone:
            raise SolutionGone(self.gone)
        left = self.deadline - time.monotonic()
        if left <= 0.002:
            raise JudgeTimeout()
        self.seq += 1
        msg["timeout"], msg["seq"] = left, self.seq
        try:
            send(self.wfd, msg)
            # The solution stops itself at the deadline; a little later, the judge does.
            reply = recv(self.rfd, self.deadline + min(0.5, max(0.05, left * 0.1)))
        except JudgeTimeout:
            self.kill("the solution did not stop at its time limit")
            raise
        except (SolutionGone, OSError) as exc:
            self.kill(str(exc) or "the solution's process ended")
            raise SolutionGone(self.gone) from None
        if type(reply) is not dict or reply.get("seq") != self.seq:
            self.kill("the solution broke the protocol")
            raise SolutionGone(self.gone)
        if reply.get("timeout") is True or time.monotonic() > self.deadline:
            raise JudgeTimeout()  # an answer after the deadline counts for nothing
        return reply

    def value(self, reply):
        if "raise" in reply:
            raise _rebuild(reply["raise"])
        if "value" not in reply:
            self.kill("the solution sent a malformed message")
            raise SolutionGone(self.gone)
        return self.decode(reply["value"])

    def decode(self, data):
        try:
            return decode(data, Ref)
        except (ValueError, TypeError, RecursionError) as exc:
            self.kill("the solution sent data that is not plain data: %s" % exc)
            raise SolutionGone(self.gone) from None

    def resolve(self, names):
        reply = self.rpc({"op": "resolve", "names": names})
        values = reply.get("values")
        if type(values) is not dict:
            return {}
        return {n: self.decode(v) for n, v in values.items() if n in names}

    def kill(self, why):
        if not self.gone:
            self.gone = why
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass


def _rebuild(info):
    """The solution's exception as one the test can catch: the first built-in
    exception type in its class's MRO (``class BadInput(ValueError)`` is caught by
    ``except ValueError``), else :class:`CandidateError`."""
    if type(info) is not dict:
        return CandidateError("the solution raised an exception")
    name, message = str(info.get("type", "")), str(info.get("message", ""))[:2000]
    mro = info.get("mro") if type(info.get("mro")) is list else [name]
    exc = None
    for cls_name in mro[:32]:
        cls = getattr(builtins, cls_name, None) if isinstance(cls_name, str) else None
        if (isinstance(cls, type) and issubclass(cls, Exception)
                and not issubclass(cls, (StopIteration, StopAsyncIteration))):
            try:
                exc = cls(message)
            except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError wants 5 arguments
                exc = None
            break
    if exc is None or type(exc) is Exception:
        exc = CandidateError("%s: %s" % (name, message))
    exc._corral_from_solution = True
    exc.solution_traceback = str(info.get("traceback", ""))[-4000:]
    return exc


def free_names(code):
    """Names a compiled test reads or writes at its top level or as globals of its
    functions: what may come from the solution (a name the solution defines shadows a
    built-in, as it would in the solution's own namespace: ``def max(xs)`` tasks).
    Over-inclusive (an attribute's name is listed too), which only costs a lookup."""
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return sorted(n for n in names if not n.startswith("__"))


def _solution_error(exc):
    import traceback

    tb = getattr(exc, "solution_traceback", "")
    own = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
    return (tb + "\n" + own) if tb else own


def run_test(judge, index, source, deadline):
    judge.deadline = deadline
    try:
        code = compile(source, "<test %d>" % index, "exec")
        names = free_names(code)
        ns = {"__builtins__": builtins, "__name__": TEST_MODULE}
        ns.update(judge.resolve(names) if names else {})
        exec(code, ns)
    except JudgeTimeout:
        return "timeout", "timed out"
    except Unsplittable as exc:
        return "unsplittable", str(exc)
    except SolutionGone as exc:
        return "error", "the solution's process stopped answering: %s" % (judge.gone or exc)
    except NotPlainData as exc:
        return "error", "%s: %s" % (type(exc).__name__, exc)
    except BaseException as exc:
        return "error", _solution_error(exc)
    return "ok", None


def judge_main():
    t0 = time.monotonic()
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise SystemExit("corral judge: cannot make itself non-dumpable")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no KeyboardInterrupt mid-exchange
    if not kill_others():
        raise SystemExit("corral judge: other processes of the sandbox would not stop")
    capture = os.fdopen(os.memfd_create("corral-output"), "w+b")
    to_sol_r, to_sol_w = os.pipe()
    from_sol_r, from_sol_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(capture.fileno(), 1)
            os.dup2(capture.fileno(), 2)
            os.dup2(to_sol_r, 3)
            os.dup2(from_sol_w, 4)
            os.closerange(5, 1 << 16)
            for fd in (3, 4):
                os.set_inheritable(fd, False)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.stdin = open(os.devnull)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            solution_main(3, 4)
        finally:
            os._exit(0)
    os.close(to_sol_r)
    os.close(from_sol_w)
    report_fd = os.dup(1)
    os.set_inheritable(report_fd, False)
    os.write(report_fd, (READY + "\n").encode())
    req = json.loads(sys.stdin.buffer.readline())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(capture.fileno(), 1)  # what the tests print goes with the solution's output
    global JUDGE
    JUDGE = judge = Judge(from_sol_r, to_sol_w, pid)
    judge.deadline = t0 + req["budget"]
    sys.modules[req["module"]] = SolutionModule(req["module"])
    load = load_solution(judge, req)
    results = []
    for i, test in enumerate(req["tests"]):
        if load[0] != "ok":
            results.append(["skipped", "not run: the solution did not load"])
            continue
        test_deadline = t0 + req["budget"]
        if req["test_timeout"]:
            test_deadline = min(test_deadline, time.monotonic() + req["test_timeout"])
        state, err = run_test(judge, i, test, test_deadline)
        results.append([state, err[-req["max_error"]:] if err else None])
    judge.kill("done")
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    sys.stdout.flush()
    capture.seek(0, 2)
    size = capture.tell()
    capture.seek(max(0, size - req["max_output"] * 4))
    out = capture.read().decode(errors="replace")[-req["max_output"]:]
    report = {"load": load, "tests": results, "output": out, "elapsed": time.monotonic() - t0}
    os.write(report_fd, (req["nonce"] + json.dumps(report) + "\n").encode())


def load_solution(judge, req):
    """``[state, error]`` of running the solution's top level in its process."""
    try:
        reply = judge.rpc({"op": "load", "ref": None, "code": req.get("code"),
                           "filename": req["filename"], "module": req["module"]})
    except JudgeTimeout:
        judge.kill("the solution did not stop at its time limit")
        return ["timeout", "timed out while loading the solution"]
    except SolutionGone as exc:
        return ["error", "the solution's process ended while loading: %s" % exc]
    if "raise" in reply:
        info = reply["raise"] if type(reply["raise"]) is dict else {}
        return ["error", str(info.get("traceback", ""))[-req["max_error"]:]]
    return ["ok", None]


def kill_others():
    """SIGKILL every process of the sandbox but pid 1 (the agent) and this one, until
    none is left but zombies; ``True`` if that happened within ~2 s."""
    me = os.getpid()
    try:
        with open("/proc/1/cmdline", "rb") as f:
            init = f.read().split(b"\0")[0]
    except OSError:
        init = b""
    if os.geteuid() == 0 or init != b"/.corral/agent":
        return False  # never outside a corral sandbox: kill(-1) would hit the host
    for _ in range(400):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return True
        if not any(_alive(entry, me) for entry in os.listdir("/proc")):
            return True
        time.sleep(0.005)
    return False


def _alive(entry, me):
    if not entry.isdigit() or int(entry) in (1, me):
        return False
    try:
        with open("/proc/%s/stat" % entry, "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


JUDGE = None

if __name__ == "__main__":
    judge_main()
