"""Shared fixtures: a real engine on a private state directory, and a real daemon."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT_REASON = "needs root, bubblewrap and cgroups (CI runs as root)"


def have_root_runtime() -> bool:
    return os.geteuid() == 0 and shutil.which("bwrap") is not None


requires_root = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)


@pytest.fixture
def state_dir():
    d = Path(tempfile.mkdtemp(prefix="corral-test-state-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def engine(state_dir):
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    from corral.runtime.engine import Engine

    eng = await Engine.open(state_dir)
    try:
        yield eng
    finally:
        await eng.close()


def stored_bytes(root: Path, pattern: str = "*") -> list[tuple[Path, bytes]]:
    """Every regular file under ``root`` whose name matches ``pattern``, with its bytes.

    A shared daemon tears sandboxes down in the background while a test looks, so a
    directory or file that vanishes mid-walk is skipped, not an error (a recursive
    ``Path.rglob`` raises FileNotFoundError then: CI failed on it once)."""
    import fnmatch

    found = []
    for top, _dirs, names in os.walk(root):  # os.walk ignores vanished directories
        for name in fnmatch.filter(names, pattern):
            path = Path(top, name)
            try:
                if path.is_file() and not path.is_symlink():
                    found.append((path, path.read_bytes()))
            except (FileNotFoundError, NotADirectoryError):
                continue
    return found


def _wait_for_socket(path: Path, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    # Generous: a daemon starts slowly on a loaded host; one that dies fails at once.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        if path.exists():
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(str(path))
                return
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.05)
    raise RuntimeError("daemon did not start listening in time")


def _base_dir() -> Path:
    base = Path(tempfile.mkdtemp(prefix="corral-test-daemon-"))
    # mkdtemp makes it 0700; sandboxes run as an unprivileged host uid and bwrap must
    # traverse the path to their root directory (the engine makes its own dirs 0711).
    os.chmod(base, 0o711)
    return base


class Daemon:
    """A real `corral serve` process on a private socket and state directory."""

    def __init__(
        self, base: Path, extra_args: list[str] | None = None, wrapper: list[str] | None = None
    ) -> None:
        self.base = base
        self.wrapper = wrapper or []  # a command the daemon runs under (tests/test_deploy.py)
        self.socket = base / "corral.sock"
        self.state_dir = base / "state"
        self.log = base / "daemon.log"
        self.args = extra_args or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> "Daemon":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "ab") as log:  # (the daemon keeps its own copy)
            self.proc = subprocess.Popen(
                [*self.wrapper, sys.executable, "-m", "corral.server", "--socket",
                 str(self.socket), "--state-dir", str(self.state_dir), *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        try:
            _wait_for_socket(self.socket, self.proc)
            if "--tcp" in self.args:  # bound just after the socket: wait for it too
                self._wait_for_tcp(self.args[self.args.index("--tcp") + 1])
        except BaseException:
            self.stop()  # a slow start left running would outlive the test (seen at load 30)
            raise
        return self

    def _wait_for_tcp(self, address: str, timeout: float = 60.0) -> None:
        host, _, port = address.rpartition(":")
        if port == "0":  # the daemon picks the port: nothing to wait for here
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{tail}")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"daemon did not listen on {address} in time")

    def stop(self) -> None:
        """SIGINT: the daemon stops with its sandboxes (SIGTERM would hand them over to
        the next daemon on the state dir: docs/restart.md)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def daemon():
    """One daemon shared by the tests of a session (they must clean up after themselves)."""
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    base = _base_dir()
    d = Daemon(base).start()
    yield d
    d.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def make_daemon():
    """Start extra daemons with their own arguments; stopped after the test."""
    started: list[Daemon] = []

    def factory(*args: str) -> Daemon:
        if not have_root_runtime():
            pytest.skip(ROOT_REASON)
        base = _base_dir()
        d = Daemon(base, list(args)).start()
        started.append(d)
        return d

    yield factory
    for d in started:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


def pytest_collection_modifyitems(items):
    """schemathesis names each API operation's item ``test[GET /path]`` but, under pytest 9,
    leaves its nodeid the function's (it sets ``_nodeid``, which pytest no longer reads):
    xdist runs items by nodeid, so it would run one operation of the fuzz. Each such item
    gets its own nodeid, from its name."""
    for item in items:
        if item.parent is not None and item.name != item.nodeid.rsplit("::", 1)[-1]:
            item._id = item.parent.id.child(item.name)


# ``make test`` runs the suite on several pytest-xdist workers (``--dist loadfile``):
# each test module stays on one worker (its module fixtures are set up once). Modules
# that share something of the host's run one after another on one worker, as in a serial
# run: those that start a Ray cluster (one at a time on a host: the session's own,
# tests/cluster/conftest.py), and those that give servers fixed addresses in network
# namespaces (tests/security/net_helpers.py's server_ns). (xdist's ``loadgroup`` cannot
# do this under pytest 9: it renames items by ``_nodeid``.)
_SHARED_UNITS = (
    (" ray", re.compile(r"^\s*(import ray|from ray)\b|ray_cluster|ray_token_cluster|"
                        r"corral_cluster|tenants_on_cluster|importorskip\(\"ray\"", re.M)),
    (" net", re.compile(r"server_ns|net_helpers")),
)
_ROOT = Path(__file__).resolve().parent.parent


def _work_unit(module: str) -> str:
    """The xdist work unit of ``module`` (a path from the root): its own, or a shared one."""
    path = _ROOT / module
    if path.parent.name == "cluster":
        return " ray"
    try:
        text = path.read_text()
    except OSError:
        return module
    return next((unit for unit, pattern in _SHARED_UNITS if pattern.search(text)), module)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedUnits(LoadFileScheduling):
        """A module per work unit, but one unit for all modules sharing a host resource."""

        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self._units: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in self._units:
                self._units[module] = _work_unit(module)
            return self._units[module]

    return SharedUnits(config, log)


# Some security tests build trees deeper than Python's recursion limit (deep-path
# attacks). pytest's own clean-up of old tmp dirs (shutil.rmtree, at a later session's
# start and exit) raises RecursionError on them, which ended an xdist worker and with it
# the whole run; a dir it renamed to garbage-* for deletion then broke every later
# session. Such trees are removed here without recursion (corral's own remove_tree).
_DEEP = 400  # levels: rmtree's recursion needs about one frame a level


def _remove_deep_trees(base: Path) -> None:
    from corral.runtime.treecopy import remove_tree

    try:
        found = subprocess.run(
            ["find", str(base), "-mindepth", str(_DEEP), "-maxdepth", str(_DEEP),
             "-type", "d", "-print"], capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    tops = {base / Path(p).relative_to(base).parts[0] for p in found.splitlines() if p}
    for top in tops:
        try:
            remove_tree(top)
        except OSError:
            pass


PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
              "http_proxy", "https_proxy", "all_proxy", "no_proxy")


def _no_proxies() -> None:
    """A runner may set ``HTTP_PROXY``/``HTTPS_PROXY`` (the suite needs no internet:
    every test talks to loopback or a namespace it made). Followed, it would take the
    third-party clients' requests to a daemon on loopback (e2b, tensorlake, cwsandbox
    honour it) and a policy sandbox's allowed traffic (the engine sends it through the
    host's proxy: docs/network.md) to that proxy. The tests that mean a proxy set their
    own (test_network_policy, test_inherited_daemon: corral's clients never use one)."""
    for name in PROXY_VARS:
        os.environ.pop(name, None)


def rt_sigaction(signum: int, handler: int | None = None) -> int:
    """The disposition of ``signum`` (0: SIG_DFL, 1: SIG_IGN, else a handler), set to
    ``handler`` first if given. Through the syscall itself: libc, and so Python's
    ``signal``, refuse 32 and 33, which a runner can hand down ignored all the same."""
    import ctypes
    import platform

    nr = {"x86_64": 13, "aarch64": 134}[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    old = (ctypes.c_ulong * 4)()  # struct kernel_sigaction: handler, flags, restorer, mask
    new = None if handler is None else ctypes.byref((ctypes.c_ulong * 4)(handler, 0, 0, 0))
    if libc.syscall(nr, signum, new, ctypes.byref(old), 8) != 0:
        raise OSError(ctypes.get_errno(), f"rt_sigaction({signum})")
    return old[0]


def _default_signals() -> None:
    """A runner may hand down signals ignored or blocked (SIG_IGN and the mask survive
    ``execve``: CI's ignored signal 32). Every program a test starts would inherit them
    from this process: with ``SIGCHLD`` ignored, each exit status a test reads is 0;
    with ``SIGTERM`` ignored or blocked, a helper a test terminates never stops. Put
    back as a fresh Python has them (``SIGPIPE`` ignored, ``SIGINT`` raising
    KeyboardInterrupt); tests/security/test_inherited_state.py checks."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for s in set(range(32, 34)) - signal.valid_signals():  # glibc's: unused if ignored
        if rt_sigaction(s) == 1:
            rt_sigaction(s, 0)
    for s in signal.valid_signals():
        if s in (signal.SIGPIPE, signal.SIGKILL, signal.SIGSTOP):
            continue
        if signal.getsignal(s) == signal.SIG_IGN:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)


def _reachable_tmpdir() -> None:
    """A runner's ``TMPDIR`` may be private (0700): the state directories tests make
    there would be out of every sandbox user's reach (the engine refuses to start
    sandboxes there). Then the first of ``/tmp`` and ``/var/tmp`` they can reach."""
    from corral.runtime.startup import unreachable_ancestor

    if unreachable_ancestor(Path(tempfile.gettempdir()) / "state") is None:
        return
    for cand in ("/tmp", "/var/tmp"):
        if os.path.isdir(cand) and unreachable_ancestor(Path(cand) / "state") is None:
            os.environ["TMPDIR"] = cand
            tempfile.tempdir = None  # computed again from TMPDIR
            return


def pytest_configure(config):
    _no_proxies()  # (in each worker too: it inherits the runner's environment)
    _default_signals()
    _reachable_tmpdir()
    if hasattr(config, "workerinput"):
        return
    import getpass

    from corral.runtime.treecopy import remove_tree

    temproot = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
    try:
        root = Path(temproot) / f"pytest-of-{getpass.getuser()}"
    except (KeyError, OSError):
        return
    for garbage in root.glob("garbage-*"):  # dirs pytest gave up deleting
        try:
            remove_tree(garbage)
        except OSError:
            pass


def pytest_sessionfinish(session):
    factory = getattr(session.config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None)
    if base is not None:
        _remove_deep_trees(Path(base))
