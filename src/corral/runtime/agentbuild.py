"""Compile the in-sandbox agent (``agent/agent.c``) once per source version.

The binary is static, so it runs in any image, with or without a libc of its own.
It is linked against musl where ``musl-gcc`` is installed (Debian's ``musl-tools``,
which ``make install`` adds), else glibc (``CORRAL_AGENT_LIBC=glibc`` asks for glibc).
The same binary is the launcher and the agent, so every create starts it twice. A
static glibc program probes the CPU before ``main`` (``init_cpu_features`` and the
cache-size probes: dozens of ``CPUID`` instructions, which no ``GLIBC_TUNABLES``
setting skips), and in a VM that traps ``CPUID`` each one is a VM exit (~7 us here):
its start cost 0.55-0.65 ms against 0.07 ms for the musl build (the launch chain rows
of ``benchmarks/profile_engine.py``). musl has no ``_FORTIFY_SOURCE``; its build has
the stack protector instead. ``PATH`` is searched by the agent itself, as glibc's
``execvp`` does, whichever libc it is built with (``agent/exec.c``).

``agent.c`` includes the other ``agent/*.c`` files (one translation unit). It is cached
in the cache directory under a name derived from the hash of all of them: a changed
source is rebuilt the first time an engine opens.

Next to the binary lies its *layer*, ``<binary>.layer/.corral/agent`` (a hard link): the
topmost lower layer of every sandbox's overlay, so the agent is at ``/.corral/agent``
without a bind mount, whose source path (the cache directory) the sandbox would read
in ``/proc/self/mountinfo``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from corral.errors import Unsupported
from corral.runtime.paths import Layout
from corral.runtime.rootfs import AGENT_DIR

CFLAGS = ["-static", "-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2"]
MUSL_CFLAGS = ["-static", "-O2", "-Wall", "-Wextra", "-fstack-protector-strong"]
# The kernel's uapi headers musl-gcc leaves out of its search path (linux/*.h, asm/*.h):
# the agent's only non-libc headers; they describe the kernel, not glibc.
KERNEL_HEADERS = ("linux", "asm-generic", "asm")
INCLUDE = Path("/usr/include")


def compiler(libc: str | None = None) -> tuple[str, list[str]] | None:
    """The C compiler the agent is built with and its flags, or None (no compiler).

    ``libc`` is ``"musl"`` (the default where ``musl-gcc`` is installed) or ``"glibc"``;
    without it, the environment variable ``CORRAL_AGENT_LIBC`` (same values) decides."""
    libc = libc or os.environ.get("CORRAL_AGENT_LIBC") or "musl"
    if libc == "musl":
        musl = shutil.which("musl-gcc")
        if musl and _kernel_header_dirs():
            return musl, MUSL_CFLAGS
    cc = shutil.which("gcc") or shutil.which("cc")
    return (cc, CFLAGS) if cc else None


def _kernel_header_dirs() -> dict[str, Path]:
    """Where the kernel's uapi header folders are (``asm`` is per architecture)."""
    found = {}
    for name in KERNEL_HEADERS:
        for cand in (INCLUDE / name, *sorted(INCLUDE.glob(f"*-linux-gnu/{name}"))):
            if cand.is_dir():
                found[name] = cand
                break
    return found if len(found) == len(KERNEL_HEADERS) else {}


def agent_sources() -> dict[str, bytes]:
    """The agent's C sources by file name (``agent.c`` is the one compiled)."""
    folder = resources.files("corral.runtime").joinpath("agent")
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.name.endswith(".c")}


def agent_path(layout: Layout, sources: dict[str, bytes] | None = None,
               flags: list[str] | None = None) -> Path:
    """Where the agent of these sources (built with ``flags``) is (or will be) compiled."""
    sources = agent_sources() if sources is None else sources
    if flags is None:
        found = compiler()
        flags = found[1] if found else CFLAGS
    h = hashlib.sha256(" ".join(flags).encode())
    for name in sorted(sources):
        h.update(b"\0%s\0%d\0" % (name.encode(), len(sources[name])) + sources[name])
    return layout.bin_dir / f"corral-agent-{h.hexdigest()[:16]}"


def ensure_agent(layout: Layout, libc: str | None = None) -> Path:
    """Return the path of the compiled agent, building it if this source is new
    (``libc``: see :func:`compiler`)."""
    sources = agent_sources()
    found = compiler(libc)
    flags = found[1] if found else CFLAGS
    target = agent_path(layout, sources, flags)
    digest = target.name.rsplit("-", 1)[1]
    if target.exists():
        _ensure_layer(target)
        return target
    if found is None:
        raise Unsupported(
            "no C compiler found to build the sandbox agent: install gcc and libc6-dev "
            "(make install does this)"
        )
    cc = found[0]
    layout.bin_dir.mkdir(parents=True, exist_ok=True)
    with open(layout.bin_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        tmp_src = layout.bin_dir / f".agent-{digest}.{os.getpid()}.src"
        tmp_bin = layout.bin_dir / f".agent-{digest}.{os.getpid()}"
        shutil.rmtree(tmp_src, ignore_errors=True)
        tmp_src.mkdir()
        for name, data in sources.items():
            (tmp_src / name).write_bytes(data)
        include = []
        if flags is MUSL_CFLAGS:  # the kernel's headers, and nothing else of glibc's
            (tmp_src / "include").mkdir()
            for name, path in _kernel_header_dirs().items():
                (tmp_src / "include" / name).symlink_to(path)
            include = ["-isystem", str(tmp_src / "include")]
        proc = subprocess.run(
            [cc, *flags, *include, "-o", str(tmp_bin), str(tmp_src / "agent.c")],
            capture_output=True, text=True,
        )
        shutil.rmtree(tmp_src, ignore_errors=True)
        if proc.returncode != 0:
            tmp_bin.unlink(missing_ok=True)
            raise Unsupported(f"building the sandbox agent failed:\n{proc.stderr.strip()}")
        os.chmod(tmp_bin, 0o755)
        os.replace(tmp_bin, target)
    _ensure_layer(target)
    return target


def agent_layer(agent: Path) -> Path:
    """The overlay lower layer that holds ``agent`` as ``/.corral/agent``."""
    return agent.with_name(agent.name + ".layer")


def _ensure_layer(agent: Path) -> None:
    layer = agent_layer(agent)
    if (layer / AGENT_DIR / "agent").exists():
        return
    tmp = agent.with_name(f".{agent.name}.{os.getpid()}.layer")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / AGENT_DIR).mkdir(parents=True)
    for d in (tmp, tmp / AGENT_DIR):
        os.chmod(d, 0o755)  # whatever the umask: bwrap, as the sandbox's uid, execs it
    os.link(agent, tmp / AGENT_DIR / "agent")
    try:
        os.rename(tmp, layer)
    except OSError:  # another engine made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if not (layer / AGENT_DIR / "agent").exists():
            raise
