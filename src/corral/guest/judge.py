"""The test judge: runs inside the sandbox as ``python3 -I -c <wire + this file>``.

Not imported by corral on the host (but by its tests); :mod:`corral.rl._grading` sends
the text of :mod:`corral.guest.confine`, :mod:`corral.guest.judge_wire`,
:mod:`corral.guest.judge_solution` (the solution process) and this file as the command. The design,
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
  through the strict decoder of :mod:`corral.guest.judge_wire`. A handle can be called,
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
    from corral.guest.confine import confine
    from corral.guest.judge_solution import solution_main
    from corral.guest.judge_wire import (
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
TEST_MODULE = "__corral_test__"  # the tests' __name__


class NotPlainData(BaseException):
    """A handle was compared, hashed or tested for truth, or the test tried to pass the
    solution something that came from it and is not plain data."""


class CandidateError(Exception):
    """An exception of the solution that is not a built-in exception type."""


class Unsplittable(BaseException):
    """A test passed an object of its own that is not plain data to the solution."""


class Ungradable(BaseException):
    """A test the judge cannot grade at all (it says why); never scored as a failure."""


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

    def __eq__(self, other):  # noqa: F811 - two of the solution's objects: by their state
        if not isinstance(other, Ref):
            self._refuse()
        return JUDGE.same(self, other)

    def __ne__(self, other):  # noqa: F811
        return not self.__eq__(other)

    def __setattr__(self, name, value):
        JUDGE.setattr(self._id, name, value)

    def __delattr__(self, name):
        JUDGE.setattr(self._id, name)

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
    """``import solution`` / ``from solution import f`` in a test; ``solution.LIMIT = 3``
    (and ``mock.patch.object``) changes the solution's own module."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        values = JUDGE.resolve([name])[0]
        if name not in values:
            raise AttributeError("the solution defines no %r" % name)
        return values[name]

    def __setattr__(self, name, value):
        if name.startswith("__"):
            return super().__setattr__(name, value)
        JUDGE.setattr(None, name, value)

    def __delattr__(self, name):
        if name.startswith("__"):
            return super().__delattr__(name)
        JUDGE.setattr(None, name)


ORIGINAL = {"input": builtins.input, "print": builtins.print}
_NO_VALUE = object()


def _stdin_feed():
    """What the test feeds the solution's stdin (``sys.stdin = io.StringIO(...)``, or
    ``mock.patch("sys.stdin", ...)``): ``(stream, text, position)``, or ``None`` when
    the judge's own stdin (nothing) is in place."""
    import io

    stream = sys.stdin
    if stream is JUDGE.stdin:
        return None
    if isinstance(stream, io.StringIO):
        pos = stream.tell()
        return stream, stream.getvalue()[pos:], pos
    text = stream.read()
    text = text.decode(errors="replace") if isinstance(text, (bytes, bytearray)) else str(text)
    sys.stdin = io.StringIO(text)
    return sys.stdin, text, 0


# Standard modules whose import does something (opens a browser, prints, starts Tk):
# never imported on a solution's say-so.
NO_IMPORT = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo",
                       "webbrowser", "pydoc", "venv", "ensurepip", "site"})


def _stdlib_module(name, ref_id):
    """A module the solution holds: the judge's own copy if it is the standard
    library's (a test's ``math.isclose`` is never the solution's), else a handle."""
    import importlib

    top = name.split(".")[0]
    if top in sys.stdlib_module_names and not top.startswith("_") and top not in NO_IMPORT:
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    return Ref(ref_id)


class Judge:
    def __init__(self, rfd, wfd, pid):
        self.rfd, self.wfd, self.pid = rfd, wfd, pid
        self.deadline = None
        self.gone = None
        self.seq = 0
        self.stdin = sys.stdin
        self.compared = False  # the current test compared two of the solution's objects
        self._comparing = set()

    def rpc(self, msg):
        if self.gone:
            raise SolutionGone(self.gone)
        left = self.deadline - time.monotonic()
        if left <= 0.002:
            raise JudgeTimeout()
        if builtins.input is not ORIGINAL["input"] or builtins.print is not ORIGINAL["print"]:
            raise Unsplittable("the test replaces input() or print(), which the solution's "
                               "process cannot see")
        feed = _stdin_feed()
        if feed is not None:
            msg["stdin"] = feed[1]
        self.seq += 1
        msg["timeout"], msg["seq"] = left, self.seq
        reply = self._exchange(msg, left)
        self._streams(reply, feed)
        if reply.get("timeout") is True or time.monotonic() > self.deadline:
            raise JudgeTimeout()  # an answer after the deadline counts for nothing
        return reply

    def _streams(self, reply, feed):
        """What the solution printed goes to the test's ``sys.stdout``/``stderr`` (a
        ``redirect_stdout`` sees it); the stdin it used is consumed on the test's side."""
        out, err = reply.get("out"), reply.get("err")
        if type(out) is str and out:
            sys.stdout.write(out)
        if type(err) is str and err:
            sys.stderr.write(err)
        left = reply.get("stdin_left")
        if feed is not None and type(left) is int and 0 <= left <= len(feed[1]):
            feed[0].seek(feed[2] + len(feed[1]) - left)

    def same(self, a, b):
        """``a == b`` for two of the solution's objects: the same object, or objects of
        the same class whose state (``vars`` and slots) is equal. The state is what the
        solution's process reports, so the test is flagged (docs/grading.md)."""
        self.compared = True
        if a._id == b._id:
            return True
        key = (a._id, b._id)
        if key in self._comparing:  # a cycle: equal unless something else differs
            return True
        self._comparing.add(key)
        try:
            ra, rb = (self.rpc({"op": "state", "ref": r._id}) for r in (a, b))
            if type(ra.get("cls")) is not int or ra.get("cls") != rb.get("cls"):
                return False
            sa, sb = self.value(ra), self.value(rb)
            return sa is not None and sb is not None and sa == sb
        finally:
            self._comparing.discard(key)

    def setattr(self, ref_id, name, value=_NO_VALUE):
        msg = {"op": "setattr", "ref": ref_id, "name": str(name)}
        if value is not _NO_VALUE:
            msg["value"] = _send_arg(value)
        reply = self.rpc(msg)
        if "raise" in reply:
            raise _rebuild(reply["raise"])

    def _exchange(self, msg, left):
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
            return decode(data, Ref, 0, _stdlib_module)
        except (ValueError, TypeError, RecursionError) as exc:
            self.kill("the solution sent data that is not plain data: %s" % exc)
            raise SolutionGone(self.gone) from None

    def resolve(self, names, probe=()):
        """The solution's values of ``names``, and which of ``probe`` it defines."""
        reply = self.rpc({"op": "resolve", "names": list(names), "probe": list(probe)})
        values, defined = reply.get("values"), reply.get("defined")
        values = {n: self.decode(v) for n, v in values.items() if n in names} \
            if type(values) is dict else {}
        defined = [n for n in defined if n in probe] if type(defined) is list else []
        return values, defined

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


GLOBAL_LOADS = frozenset({"LOAD_NAME", "LOAD_GLOBAL", "DELETE_NAME", "DELETE_GLOBAL"})
GLOBAL_STORES = frozenset({"STORE_NAME", "STORE_GLOBAL"})
BUILTIN_NAMES = frozenset(dir(builtins))


def free_names(code):
    """``(read, stored)``: the global names a compiled test reads (at its top level, in
    its functions, classes and comprehensions), and those it binds itself."""
    import dis

    read, stored, todo = set(), set(), [code]
    while todo:
        c = todo.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in GLOBAL_LOADS:
                read.add(ins.argval)
            elif ins.opname in GLOBAL_STORES:
                stored.add(ins.argval)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return sorted(n for n in read if not n.startswith("__")), stored


def task_names(code, entry_point):
    """Which names of a test come from the solution, and which built-ins to ask it
    about. Built-ins come from the judge: a solution's ``range = lambda *a: []`` must
    not turn ``for i in range(10): assert ...`` into a pass. The exception is the
    task's own name (``entry_point``, e.g. HumanEval's ``def max``), and what a test
    imports (``from solution import max``), which its import statement binds."""
    read, stored = free_names(code)
    ask = [n for n in read if n not in BUILTIN_NAMES or n == entry_point]
    if entry_point:  # the task's name is known: every other built-in is the judge's
        return ask, []
    # Not known: a built-in the solution redefines may be the task's function (``def
    # max``) or a hack; the test is not gradable rather than judged either way.
    probe = [n for n in read if n in BUILTIN_NAMES and n not in stored]
    return ask, probe


class _Missing:
    """The task's function, which the solution does not define: using it fails."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NameError("the solution defines no %r (the task's function)" % self.name)

    def __getattr__(self, attr):
        raise NameError("the solution defines no %r (the task's function)" % self.name)


def _solution_error(exc):
    import traceback

    tb = getattr(exc, "solution_traceback", "")
    own = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
    return (tb + "\n" + own) if tb else own


def run_test(judge, index, source, deadline, entry_point=None):
    judge.deadline = deadline
    judge.compared = False
    try:
        code = compile(source, "<test %d>" % index, "exec")
        ask, probe = task_names(code, entry_point)
        ns = {"__builtins__": builtins, "__name__": TEST_MODULE}
        if ask or probe:
            values, shadowed = judge.resolve(ask, probe)
            if shadowed:
                raise Ungradable(
                    "the solution defines %s, a built-in name this test uses: the test "
                    "cannot tell whether it means the built-in or the solution's; name the "
                    "task's function (entry_point=) or import it in the test (from "
                    "solution import ...)" % ", ".join(shadowed))
            ns.update(values)
        if entry_point and entry_point in ask and entry_point not in ns:
            # The task's function, missing: never the built-in of the same name.
            ns[entry_point] = _Missing(entry_point)
        sys.stdin, sys.stdout = judge.stdin, judge.stdout
        exec(code, ns)
    except JudgeTimeout:
        return "timeout", "timed out"
    except Ungradable as exc:
        return "ungradable", str(exc)
    except Unsplittable as exc:
        return "unsplittable", str(exc)
    except SolutionGone as exc:
        return "error", "the solution's process stopped answering: %s" % (judge.gone or exc)
    except NotPlainData as exc:
        return "error", "%s: %s" % (type(exc).__name__, exc)
    except BaseException as exc:
        return "error", _solution_error(exc)
    return "ok", None


# What a pre-started judge (``python3 -I -c JUDGE warm``: corral.rl._prestart) imports
# before READY, so that neither it nor the solution process it forks pays for them once
# the completion is there: the judge's own (dis, for every test) and what solutions
# import most (HumanEval's prompts start with ``from typing import List``). Only the
# standard library; the completion does not exist yet, so nothing of it is in them.
WARM_MODULES = ("dis", "typing", "re", "collections", "functools", "itertools", "math",
                "heapq", "bisect", "string")


def judge_main():
    confine("corral judge")
    if sys.argv[1:] == ["warm"]:
        import importlib

        for name in WARM_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
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
    # The budget counts from the request: a judge may have waited, started, in a pool
    # (corral.rl._prestart) long before its completion existed.
    t0 = time.monotonic()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdin = open(os.devnull)
    # What the tests print (and the solution's prints, which come back with each answer)
    # goes to a file of the judge's own: the solution holds its capture as its stdout,
    # so test output written there could be read back (os.pread(1, ...)).
    tests_out = os.fdopen(os.memfd_create("corral-tests-output"), "w+b")
    os.dup2(tests_out.fileno(), 1)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    global JUDGE
    JUDGE = judge = Judge(from_sol_r, to_sol_w, pid)
    judge.stdout = sys.stdout
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
        state, err = run_test(judge, i, test, test_deadline, req.get("entry_point"))
        results.append([state, err[-req["max_error"]:] if err else None, judge.compared])
    judge.kill("done")
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    sys.stdout.flush()
    out = (_tail(capture, req["max_output"]) + _tail(tests_out, req["max_output"]))
    out = out[-req["max_output"]:]
    report = {"load": load, "tests": results, "output": out, "elapsed": time.monotonic() - t0}
    os.write(report_fd, (req["nonce"] + json.dumps(report) + "\n").encode())


def _tail(f, n):
    f.seek(0, 2)
    f.seek(max(0, f.tell() - n * 4))
    return f.read().decode(errors="replace")[-n:]


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


JUDGE = None

if __name__ == "__main__":
    judge_main()
    # The verdict is written and the solution reaped: nothing is left to flush, so the
    # interpreter's finalization (~3 ms of CPU with the warm modules) is skipped.
    os._exit(0)
