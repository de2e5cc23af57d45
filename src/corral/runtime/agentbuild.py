"""Compile the in-sandbox agent (``agent/agent.c``) once per source version.

The binary is static, so it runs in any image, with or without a libc of its own.
It is cached in the cache directory under a name derived from the source's hash.
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

CFLAGS = ["-static", "-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2"]


def agent_source() -> bytes:
    return resources.files("corral.runtime").joinpath("agent/agent.c").read_bytes()


def ensure_agent(layout: Layout) -> Path:
    """Return the path of the compiled agent, building it if this source is new."""
    src = agent_source()
    digest = hashlib.sha256(src + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = layout.bin_dir / f"corral-agent-{digest}"
    if target.exists():
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise Unsupported(
            "no C compiler found to build the sandbox agent: install gcc and libc6-dev "
            "(make install does this)"
        )
    layout.bin_dir.mkdir(parents=True, exist_ok=True)
    with open(layout.bin_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        tmp_src = layout.bin_dir / f".agent-{digest}.c"
        tmp_bin = layout.bin_dir / f".agent-{digest}.{os.getpid()}"
        tmp_src.write_bytes(src)
        proc = subprocess.run(
            [cc, *CFLAGS, "-o", str(tmp_bin), str(tmp_src)], capture_output=True, text=True
        )
        tmp_src.unlink(missing_ok=True)
        if proc.returncode != 0:
            tmp_bin.unlink(missing_ok=True)
            raise Unsupported(f"building the sandbox agent failed:\n{proc.stderr.strip()}")
        os.chmod(tmp_bin, 0o755)
        os.replace(tmp_bin, target)
    return target
