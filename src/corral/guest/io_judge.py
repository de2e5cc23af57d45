"""The stdin/stdout judge: runs inside the sandbox as ``python3 -I -c <confine + this>``.

Sent by :mod:`corral.rl._io_grading` (docs/grading.md, "stdin/stdout problems"). Like
the Python judge it first makes itself non-dumpable, stops every other process of the
sandbox, prints ``READY`` and only then reads its request (solution, language, test
cases, limits, nonce) from stdin. Then:

1. a checker program, if the task ships one, is compiled and kept in a memory file
   (nothing the solution runs as can overwrite it); then the solution is compiled once
   (``CE`` and the compiler's message, bounded, if that fails);
2. each test case runs the program in a new session, its input on a pipe, under a CPU
   time limit (``RLIMIT_CPU`` and a wall-clock guard) and a memory limit (polled: what
   all its processes, its files and its shared memory hold, :mod:`~corral.guest.case_memory`;
   and each process's peak from ``wait4``); its output comes back on a pipe,
   bounded; afterwards every other process of the sandbox is killed, so nothing the
   solution left behind sees the next case or the checker;
3. the output is compared (exact, lines, whitespace tokens, floats with a tolerance)
   or handed to the checker, in this process or as a program with input, output and
   answer files that exist only while no process of the solution does.

Expected outputs live only in this process's memory: never on disk while the solution
runs, never in its argv, environment or memory. The verdicts go to the judge's own
stdout, which nothing else holds.
"""

import json
import math
import os
import re
import resource
import select
import shutil
import signal
import sys
import tempfile
import time

if "kill_others" not in globals():  # on the host (tests, lint); in the sandbox, these precede
    from corral.guest.case_memory import CaseMemory, forbid_sockets
    from corral.guest.confine import confine, kill_others

READY = "corral-judge-ready"
TRUSTED_PATH = "/usr/local/bin:/usr/bin:/bin"
COMPILE_TIMEOUT = 60.0
COMPILE_MESSAGE = 4000    # characters of a compiler's message kept
STDERR_KEPT = 2000        # characters of a run's stderr kept
MEM_POLL = 0.005          # seconds between two looks at a running program's memory

# Per language: source file, compile command (None: nothing to compile), run command,
# a CPU-time factor and extra seconds (a JVM or a Node start is not the solution's),
# memory the runtime itself needs above the limit, and the stderr signs of running out
# of memory. ``{mem}``: the limit in MiB; ``{main}``: Java's main class.
LANGS = {
    "python": ("main.py", ["python3", "-m", "py_compile", "main.py"],
               ["python3", "-I", "main.py"], 1.0, 0.0, 0, ("MemoryError",)),
    "c": ("main.c", ["gcc", "-O2", "-std=gnu11", "-pipe", "-DONLINE_JUDGE", "-o", "main",
                     "main.c", "-lm"], ["./main"], 1.0, 0.0, 0, ()),
    "cpp": ("main.cpp", ["g++", "-O2", "-std=gnu++17", "-pipe", "-DONLINE_JUDGE", "-o", "main",
                         "main.cpp"], ["./main"], 1.0, 0.0, 0, ("std::bad_alloc",)),
    "java": ("{main}.java", ["javac", "-encoding", "UTF-8", "-J-Xmx512m", "-d", ".",
                             "{main}.java"],
             ["java", "-Xmx{mem}m", "-Xss64m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
              "-cp", ".", "{main}"], 2.0, 1.0, 96, ("java.lang.OutOfMemoryError",)),
    "javascript": ("main.js", ["node", "--check", "main.js"],
                   ["node", "--max-old-space-size={mem}", "--stack-size=65500", "main.js"],
                   1.0, 0.5, 64, ("heap out of memory", "Allocation failed")),
    "go": ("main.go", ["go", "build", "-o", "main", "main.go"], ["./main"], 1.0, 0.0, 0,
           ("out of memory",)),
    "rust": ("main.rs", ["rustc", "-O", "--edition", "2021", "-o", "main", "main.rs"],
             ["./main"], 1.0, 0.0, 0, ("memory allocation of",)),
}

# testlib's exit codes (testlib.h's defaults: OK 0, WA 1, PE 2, FAIL 3, DIRT 4, POINTS 7,
# UNEXPECTED_EOF 8): extra output ("dirt") and an unexpected end of the output are
# presentation errors there too; FAIL is the checker's or the jury's own failure.
TESTLIB = {0: "AC", 1: "WA", 2: "PE", 3: "FAIL", 4: "PE", 7: "POINTS", 8: "PE"}


class Program:
    """A compiled program: its language, directory and run command."""

    def __init__(self, lang, workdir, argv, exe_fd=None):
        self.lang, self.workdir, self.argv, self.exe_fd = lang, workdir, argv, exe_fd


def java_main(code):
    m = re.search(r"public\s+(?:final\s+)?class\s+([A-Za-z_$][\w$]*)", code)
    return m.group(1) if m else "Main"


def compile_program(lang, code, workdir, mem_mb, files=None):
    """``(Program, None)`` or ``(None, message)`` (a compile error)."""
    src, build, run = LANGS[lang][:3]
    main = java_main(code) if lang == "java" else "main"
    fill = {"main": main, "mem": str(mem_mb)}
    src = src.format(**fill)
    for name, text in (files or {}).items():
        if "/" in name or name.startswith("."):
            return None, "bad file name %r" % (name,)
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(workdir, src), "w", encoding="utf-8") as f:
        f.write(code)
    argv = [a.format(**fill) for a in run]
    if build is None:
        return Program(lang, workdir, argv), None
    build = [a.format(**fill) for a in build]
    if shutil.which(build[0], path=TRUSTED_PATH) is None:
        raise NoToolchain("%s: %s is not installed in this image (use image='judge')"
                          % (lang, build[0]))
    r = run_program(build, workdir, b"", COMPILE_TIMEOUT, 0, 1 << 20, sweep=False,
                    env=build_env(workdir))
    if r["status"] != "exited" or r["code"] != 0:
        message = (r["stderr"] + r["stdout"].decode(errors="replace")).strip()
        if r["status"] == "timeout":
            message = "the compiler ran past %gs\n%s" % (COMPILE_TIMEOUT, message)
        return None, message[-COMPILE_MESSAGE:] or "exit status %s" % (r["code"],)
    return Program(lang, workdir, argv), None


class NoToolchain(Exception):
    """The image lacks the language's compiler or runtime: not the solution's fault."""


def build_env(workdir):
    return {"PATH": TRUSTED_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "GOCACHE": os.path.join(workdir, ".gocache"), "GO111MODULE": "off",
            "GOPATH": os.path.join(workdir, ".gopath")}


class Guard:
    """Whether a program disturbed the judge while it ran. Its processes have the
    judge's uid, so they may stop it (SIGSTOP, SIGTSTP...) or lower its scheduling
    (``setpriority``, ``sched_setscheduler(SCHED_IDLE)``): either way the judge no
    longer looks at the program's memory, which may then hold far more than its limit
    and give it back before it ends. What resumes a stopped process is SIGCONT, which
    the judge catches; its scheduling it compares with what it was at the start."""

    def __init__(self):
        self.continued = 0
        self.sched = self._sched()
        signal.signal(signal.SIGCONT, self._resumed)

    def _resumed(self, signum, frame):
        self.continued += 1

    @staticmethod
    def _sched():
        return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)

    def why(self):
        """``None``, or how the judge was disturbed."""
        if self.continued:
            return "the program stopped the judge"
        if self._sched() != self.sched:
            return "the program lowered the judge's scheduling priority"
        return None


def run_program(argv, cwd, data, wall, mem_bytes, out_cap, cpu=None, sweep=True, env=None,
                exe_fd=None, guard=None):
    """Run ``argv`` with ``data`` on its stdin. A dict: ``status`` (exited, signaled,
    timeout, memory, output, disturbed: ``guard`` says the judge was, ``why`` how),
    ``code``, ``cpu`` seconds, ``rss`` peak bytes, ``stdout`` (bytes, at most
    ``out_cap``), ``stderr`` (text, its tail)."""
    memory = CaseMemory(mem_bytes) if mem_bytes else None  # before the spawn: its baseline
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    start = time.monotonic()
    # posix_spawn (vfork underneath), not fork: a forked Python child pays copy-on-write
    # faults for every object it touches before exec, ~6 ms a case. Its directory and
    # its CPU limit come from ours, set around the spawn (this process is single-
    # threaded and ignores SIGXCPU; seccomp refuses prlimit on another process).
    actions = [(os.POSIX_SPAWN_DUP2, r_in, 0), (os.POSIX_SPAWN_DUP2, w_out, 1),
               (os.POSIX_SPAWN_DUP2, w_err, 2)]
    if exe_fd is not None:
        actions.append((os.POSIX_SPAWN_DUP2, exe_fd, 3))
        path = "/proc/self/fd/3"
    else:
        path = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=TRUSTED_PATH) or argv[0]
    here = os.getcwd()
    saved = resource.getrlimit(resource.RLIMIT_CPU)
    os.chdir(cwd)
    try:
        if cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (max(1, math.ceil(cpu)), saved[1]))
        pid = os.posix_spawn(path, argv, env or build_env(cwd), file_actions=actions,
                             setsid=True,
                             setsigdef=(signal.SIGINT, signal.SIGPIPE, signal.SIGXCPU))
    except OSError as exc:  # nothing to run (the solution deleted its own binary...)
        for fd in (r_in, w_in, r_out, w_out, r_err, w_err):
            os.close(fd)
        return {"status": "exited", "code": 127, "cpu": 0.0, "rss": 0, "stdout": b"",
                "stderr": "cannot run %s: %s" % (argv[0], exc), "stderr_head": "", "wall": 0.0}
    finally:
        resource.setrlimit(resource.RLIMIT_CPU, saved)
        os.chdir(here)
    for fd in (r_in, w_out, w_err):
        os.close(fd)
    result = _watch(pid, w_in, r_out, r_err, data, start + wall, memory, out_cap, guard)
    result["wall"] = time.monotonic() - start
    if memory is not None:  # what it left behind (orphans, files) before the sweep
        if memory.over():
            result["status"] = "memory"
        result["rss"] = max(result["rss"], memory.peak)
        result["memory_note"] = memory.why
    if sweep:
        kill_others()
        cpu, rss = _reap()  # what it left behind counts: its CPU, its peak
        result["cpu"] += cpu
        result["rss"] = max(result["rss"], rss)
    if guard is not None and guard.why():  # last: its leftovers too, until the sweep
        result["status"], result["why"] = "disturbed", guard.why()
    return result


def _reap():
    """CPU seconds and the largest peak of the processes a program left behind. This
    process is a child subreaper: an orphan of the program (double-forked, a chain of
    forks each under ``RLIMIT_CPU``) comes to it, is killed by the sweep and reaped
    here, so work or memory spread over processes is not free."""
    cpu, rss = 0.0, 0
    while True:
        try:
            pid, _, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        cpu += usage.ru_utime + usage.ru_stime
        rss = max(rss, usage.ru_maxrss * 1024)
    return cpu, rss


def _runqueue_wait(pid):
    """Seconds ``pid`` has been runnable but not running (``/proc/PID/schedstat``): time
    a loaded machine took from it, which the wall-clock guard gives back."""
    try:
        with open("/proc/%d/schedstat" % pid) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _watch(pid, w_in, r_out, r_err, data, deadline, memory, out_cap, guard=None):
    pidfd = os.pidfd_open(pid)
    # the guard stops a program that waits (sleeps, blocks); one that waited for a CPU
    # on a busy host gets that time back, up to 4x the guard in all
    guard_end, hard_end = deadline, deadline + 3 * max(0.0, deadline - time.monotonic())
    os.set_blocking(w_in, False)
    out, err = bytearray(), bytearray()
    status, view = None, memoryview(data)
    if not view:
        os.close(w_in)
        w_in = None
    readers = {r_out: out, r_err: err}
    waited = None
    try:
        while True:
            now = time.monotonic()
            if waited is None and now > deadline:
                deadline = min(hard_end, guard_end + _runqueue_wait(pid))
                if now > deadline:
                    status = "timeout"
                    break
            if memory is not None and (
                    memory.over() or waited is None and _rss(pid) > memory.limit):
                status = "memory"
                break
            if guard is not None and guard.why():
                break  # run_program reports it
            if waited is not None and not readers:
                break
            wait = max(0.0, min(deadline - now, MEM_POLL if memory else 0.05))
            if waited is not None:
                wait = 0.05  # the program ended: what is left in its pipes, briefly
            rl = list(readers) + ([pidfd] if waited is None else [])
            wl = [w_in] if w_in is not None else []
            r, w, _ = select.select(rl, wl, [], wait)
            if not r and not w and waited is not None:
                break  # a process it left behind holds the pipe: it is swept below
            if w:
                try:
                    n = os.write(w_in, view[:65536])
                    view = view[n:]
                except (BrokenPipeError, BlockingIOError):
                    n = -1
                if n < 0 or not view:
                    os.close(w_in)
                    w_in = None
            for fd in r:
                if fd == pidfd:
                    waited = os.wait4(pid, 0)
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del readers[fd]
                    os.close(fd)
                    continue
                buf = readers[fd]
                buf += chunk
                if fd == r_out and len(buf) > out_cap:
                    status = "output"
                    break
                if fd == r_err and len(buf) > 1 << 20:
                    del buf[4096:len(buf) - STDERR_KEPT * 4]  # its head and its tail
            if status:
                break
    finally:
        if waited is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                os.kill(pid, signal.SIGKILL)
            waited = os.wait4(pid, 0)
        for fd in list(readers) + ([w_in] if w_in is not None else []) + [pidfd]:
            os.close(fd)
    _, wstatus, usage = waited
    code = os.waitstatus_to_exitcode(wstatus)
    if status is None:
        status = "exited" if code >= 0 else "signaled"
    return {"status": status, "code": code, "cpu": usage.ru_utime + usage.ru_stime,
            "rss": usage.ru_maxrss * 1024, "stdout": bytes(out[:out_cap]),
            "stderr": err.decode(errors="replace")[-STDERR_KEPT:],
            "stderr_head": bytes(err[:4096]).decode(errors="replace")}


def _rss(pid):
    try:
        with open("/proc/%d/statm" % pid, "rb") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, IndexError, ValueError):
        return 0


# ------------------------------------------------------------------ comparing


def compare(how, got, expected, tol):
    """``(verdict, note)`` of output ``got`` against ``expected`` (both text)."""
    if how == "exact":
        return ("AC", None) if got == expected else ("WA", "the output differs")
    if how == "lines":
        a, b = _lines(got), _lines(expected)
        if a == b:
            return "AC", None
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return "WA", "line %d differs" % (i + 1)
        return "WA", "%d lines, expected %d" % (len(a), len(b))
    a, b = got.split(), expected.split()
    if len(a) != len(b):
        return "WA", "%d tokens, expected %d" % (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x == y:
            continue
        if how == "float" and _close(x, y, tol):
            continue
        return "WA", "token %d differs" % (i + 1)
    return "AC", None


def _lines(text):
    return [line.rstrip() for line in text.rstrip().split("\n")]


def _close(x, y, tol):
    try:
        a, b = float(x), float(y)
    except ValueError:
        return False
    if math.isnan(a) or math.isnan(b):
        return False
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


class Checker:
    """A task's own checker: a Python ``check(input, output, expected)`` run in this
    process, or a testlib-style program (``checker input output answer``, exit code).

    A verdict is ``(verdict, note, score)``: ``score`` is the case's credit in [0, 1],
    below 1 only for partial credit (``PC``): a Python checker returning a number
    between 0 and 1, or testlib's ``quitp(points)`` (exit code 7, ``points X`` on its
    stderr) with ``X`` out of the spec's ``max_points`` (default 1)."""

    def __init__(self, spec, workdir):
        self.kind = spec.get("kind", "python")
        self.program = None
        self.max_points = float(spec.get("max_points") or 1.0)
        if self.kind == "python":
            ns = {"__name__": "corral_checker"}
            exec(compile(spec["source"], "<checker>", "exec"), ns)
            self.fn = ns.get("check")
            if not callable(self.fn):
                raise CheckerBroken("the checker defines no check(input, output, expected)")
            return
        lang = spec.get("language", "cpp")
        cdir = tempfile.mkdtemp(prefix="checker-", dir=workdir)
        program, message = compile_program(lang, spec["source"], cdir, 1024, spec.get("files"))
        if program is None:
            raise CheckerBroken("the checker did not compile: %s" % message)
        if program.argv != ["./main"]:
            raise CheckerBroken("a checker program must be compiled (c, cpp, go or rust)")
        # Kept in a memory file only this process holds; the directory goes, so the
        # solution's uid has nothing on disk to swap for a checker that always accepts.
        fd = os.memfd_create("corral-checker")
        with open(os.path.join(cdir, "main"), "rb") as f:
            os.write(fd, f.read())
        shutil.rmtree(cdir, ignore_errors=True)
        ro = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY)  # exec refuses a file open
        os.close(fd)                                         # for writing (ETXTBSY)
        fd = ro
        self.program = Program(lang, workdir, ["checker", "input", "output", "answer"], fd)

    def __call__(self, given, got, expected):
        verdict, note = self._check(given, got, expected)
        if verdict.startswith("PC "):  # "PC <score>" from _partial
            return "PC", note, float(verdict[3:])
        if verdict == "FAIL":  # testlib's own "judgement failed": never the program's
            return "IE", "the checker failed (testlib FAIL): %s" % (note or "no message"), 0.0
        if verdict != "CRASH":
            return verdict, note, float(verdict == "AC")
        # It crashed on this output. A checker that accepts the expected answer is sound:
        # the output broke it (garbage where it parses a number), the program's wrong
        # answer, never "not gradable" (reward None would spare a wrong program its 0).
        if self._check(given, expected, expected)[0] == "AC":
            return "WA", "the checker failed on this output: %s" % (note or "")[-200:], 0.0
        return "IE", note, 0.0

    def _check(self, given, got, expected):
        """``(verdict, note)``; ``CRASH``: it raised, crashed or answered nonsense."""
        if self.program is None:
            try:
                verdict = self.fn(given, got, expected)
            except Exception as exc:  # noqa: BLE001 - the checker's fault, not the solution's
                return "CRASH", "the checker raised %s: %s" % (type(exc).__name__, exc)
            if isinstance(verdict, bool) or verdict in (0, 1):
                return ("AC", None) if verdict else ("WA", "the checker rejected the output")
            if isinstance(verdict, float) and 0 < verdict < 1:
                return _partial(verdict, "the checker gave %g" % verdict)
            return "CRASH", "the checker returned %r, not True, False or a score in [0, 1]" % (
                verdict,)
        # Every process of the solution is gone (swept after its run): the files exist
        # only while the checker runs.
        cdir = tempfile.mkdtemp(prefix="check-", dir=self.program.workdir)
        try:
            for name, text in (("input", given), ("output", got), ("answer", expected)):
                with open(os.path.join(cdir, name), "w", encoding="utf-8") as f:
                    f.write(text)
            r = run_program(self.program.argv, cdir, b"", 30.0, 0, 1 << 20,
                            exe_fd=self.program.exe_fd)
        finally:
            shutil.rmtree(cdir, ignore_errors=True)
        if r["status"] != "exited" or r["code"] not in TESTLIB:
            return "CRASH", "the checker failed (%s %s): %s" % (r["status"], r["code"],
                                                               r["stderr"])
        verdict, message = TESTLIB[r["code"]], r["stderr"].strip()
        if verdict == "POINTS":
            return self._points(message)
        note = None if verdict == "AC" else message[-200:] or None
        return verdict, note if verdict != "PE" else "presentation error: %s" % (note or "")

    def _points(self, message):
        """testlib's ``quitp``: ``points X [message]`` on stderr (``X`` alone before)."""
        words = message.split()
        if words[:1] == ["points"]:
            words = words[1:]
        try:
            points = float(words[0])
        except (IndexError, ValueError):
            return "CRASH", "the checker exited with points (7) but printed none: %r" % (
                message[-200:],)
        if not 0 <= points <= self.max_points or math.isnan(points):
            return "CRASH", "the checker gave %g points, outside [0, %g] (max_points)" % (
                points, self.max_points)
        return _partial(points / self.max_points, message[-200:])


def _partial(score, note):
    """A verdict with credit ``score`` in [0, 1]: full is ``AC``, none ``WA``."""
    if score >= 1:
        return "AC", None
    if score <= 0:
        return "WA", note
    return "PC %.6g" % score, note


class CheckerBroken(Exception):
    """The task's checker cannot be used: every test is not gradable."""


# ------------------------------------------------------------------ judging


def judge_case(program, case, req, checker, guard=None):
    """``[verdict, cpu seconds, peak bytes, note, score]`` of one test case (``score``:
    its credit, 1 for ``AC``, between 0 and 1 for a checker's partial credit ``PC``)."""
    lang = program.lang
    _, _, _, factor, extra, runtime_mb, oom_signs = LANGS[lang]
    tl = float(case.get("time_limit") or req["time_limit"])
    mem_mb = int(case.get("memory_mb") or req["memory_mb"])
    cpu = tl * factor + extra
    mem_bytes = (mem_mb + runtime_mb) << 20
    argv = [a.replace("{mem}", str(mem_mb)) for a in program.argv]
    # CPU time decides a TLE; the wall-clock guard only stops a program that waits
    # (sleeps, blocks), generous so a loaded machine never turns a fast one into a TLE.
    r = run_program(argv, program.workdir, case["input"].encode(), cpu * 3 + 5, mem_bytes,
                    req["output_limit"], cpu=cpu, env=build_env(program.workdir), guard=guard)
    used = [round(r["cpu"], 4), r["rss"]]
    if r["status"] == "disturbed":  # its memory went unwatched: never judged on
        return ["RE", *used, "%s while it ran" % r["why"]]
    oom = any(sign in r["stderr"] or sign in r["stderr_head"] for sign in oom_signs)
    if r["status"] == "memory" or r["rss"] > mem_bytes or (oom and r["code"] != 0):
        why = r.get("memory_note")
        return ["MLE", *used, "memory limit %d MiB exceeded%s" % (mem_mb, why and ": " + why or "")]
    if r["status"] == "timeout" or r["cpu"] > cpu or r["code"] == -signal.SIGXCPU:
        return ["TLE", *used, "time limit %gs exceeded" % tl]
    if r["status"] == "signaled" and r["code"] == -signal.SIGKILL:
        # Killed from outside while under both limits: the sandbox ran out of memory.
        return ["MLE", *used, "killed (the sandbox ran out of memory)"]
    if r["status"] == "output":
        return ["WA", *used, "output limit of %d bytes exceeded" % req["output_limit"]]
    if r["status"] != "exited" or r["code"] != 0:
        what = "signal %d" % -r["code"] if r["code"] < 0 else "exit code %d" % r["code"]
        return ["RE", *used, "%s\n%s" % (what, r["stderr"])]
    got = r["stdout"].decode(errors="replace")
    if checker is not None:
        verdict, note, score = checker(case["input"], got, case["output"])
        return [verdict, *used, note, score]
    verdict, note = compare(req["compare"], got, case["output"], req["tolerance"])
    return [verdict, *used, note, float(verdict == "AC")]


def judge_all(req):
    """The report: ``compile`` (``[state, message]``) and ``tests`` (one per case)."""
    workdir = tempfile.mkdtemp(prefix="judge-")
    cases, n = req["tests"], len(req["tests"])
    try:
        try:
            checker = Checker(req["checker"], workdir) if req.get("checker") else None
        except (CheckerBroken, NoToolchain, SyntaxError, Exception) as exc:  # noqa: BLE001
            note = "not gradable: %s" % exc
            return {"compile": ["skipped", None], "tests": [["IE", 0, 0, note[-2000:]]] * n}
        try:
            program, message = compile_program(req["language"], req["code"], workdir,
                                               req["memory_mb"])
        except NoToolchain as exc:
            return {"compile": ["no toolchain", str(exc)],
                    "tests": [["IE", 0, 0, str(exc)]] * n}
        if program is None:
            return {"compile": ["error", message], "tests": [["CE", 0, 0, None]] * n}
        forbid_sockets()  # from here on: no socket to keep memory in (case_memory)
        guard = Guard()
        results, failed = [], False
        for case in cases:
            if failed and req["stop_on_failure"]:
                results.append(["SKIP", 0, 0, None])
                continue
            results.append(judge_case(program, case, req, checker, guard))
            failed = failed or results[-1][0] != "AC"
        return {"compile": ["ok", None], "tests": results}
    finally:
        kill_others()
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    t0 = time.monotonic()
    confine("corral io judge")
    import ctypes
    if ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER: see _reap
        raise SystemExit("corral io judge: cannot become a child subreaper")
    os.umask(0o077)
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)  # the CPU limit set around each spawn
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # inherited by every program run
    report_fd = os.dup(1)
    os.set_inheritable(report_fd, False)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.write(report_fd, (READY + "\n").encode())
    req = json.loads(sys.stdin.buffer.readline())
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    report = judge_all(req)
    report["elapsed"] = time.monotonic() - t0
    os.write(report_fd, (req["nonce"] + json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    main()
