"""Attack: a sandbox holding a vfork child that never execs, beside thousands of
processes (``pids`` may be up to 65536), makes every checkpoint of it walk its whole
process list while frozen, up to 20 times per call. That walk (``mid_vfork``: a /proc
read per process, and ``ppid in pids`` over a list, quadratic) ran on the daemon's
event loop: at 30 000 processes, seconds per try, every tenant's request stalled for
each of a hostile tenant's hibernate calls. The freeze and the walk now run in a
thread (thawed on a cancel), the membership test on a set."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from corral.errors import Unsupported
from corral.runtime import checkpoint

VFORK_C = "#include <unistd.h>\nint main(void) { if (vfork() == 0) for (;;) pause(); return 0; }\n"


class _HostGroup:
    """The freezer protocol over host processes (a vfork pair and padding pids): the
    scan's thread is what is looked at, not the freeze itself."""

    def __init__(self, pids: list[int]) -> None:
        self._pids = pids
        self.threads: set[int] = set()
        self.frozen = False

    def freeze(self, timeout: float = 0) -> None:
        self.threads.add(threading.get_ident())
        self.frozen = True

    def thaw(self) -> None:
        self.frozen = False

    def pids(self) -> list[int]:
        self.threads.add(threading.get_ident())
        return list(self._pids)


@pytest.fixture
def vforked(tmp_path: Path):
    src = tmp_path / "vf.c"
    src.write_text(VFORK_C)
    try:
        subprocess.run(["cc", "-O2", "-o", str(tmp_path / "vf"), str(src)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no C toolchain to build the vfork helper: {exc}")
    parent = subprocess.Popen([str(tmp_path / "vf")])
    try:
        child = None
        for _ in range(200):
            kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
            if kids:
                child = int(kids[0])
                break
            threading.Event().wait(0.01)
        assert child is not None, "the helper never vforked"
        yield parent.pid, child
    finally:
        parent.kill()
        parent.wait()
        if child is not None:
            try:
                os.kill(child, 9)
            except ProcessLookupError:
                pass


async def test_the_vfork_scan_of_a_freeze_runs_off_the_event_loop(vforked, monkeypatch):
    parent, child = vforked
    monkeypatch.setattr(checkpoint, "FREEZE_TRIES", 3)
    group = _HostGroup([parent, child, *range(4_000_000, 4_000_000 + 2000)])
    with pytest.raises(Unsupported) as err:
        await checkpoint.freeze_for_dump(group, "sb-attack")
    assert err.value.details["cause"] == "vfork"
    assert not group.frozen  # left thawed
    assert threading.get_ident() not in group.threads, \
        "the group's processes were walked on the daemon's event loop"


def test_the_vfork_scan_is_linear_in_the_group(vforked):
    """``ppid in pids`` is asked of a set: a group of n processes costs n lookups, not n²."""
    parent, child = vforked
    asked = 0

    class Counting(list):
        def __contains__(self, item: object) -> bool:
            nonlocal asked
            asked += 1
            return super().__contains__(item)

    assert checkpoint.mid_vfork(Counting([parent, child])) == [parent]
    assert asked == 0, "each process's parent was looked for in a list"
