"""Which processes a commit cannot follow by timestamps (corral.runtime.precopy).

A write through a shared writable mapping of a file changes neither its mtime nor its
ctime once the page is mapped, so a sandbox any of whose processes maps a regular file
that way gets a whole frozen copy. Anonymous shared memory (memfd, unlinked files) and
read-only or private mappings are no such risk. The test's own children; root, as the
daemon (``/proc/PID/map_files`` needs CAP_SYS_ADMIN: without it every writable shared
mapping counts).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from corral.runtime.precopy import writable_shared_maps
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

MAPPER = """
import mmap, os, sys
kind, path = sys.argv[1], sys.argv[2]
if kind == "memfd":
    fd = os.memfd_create("x")
elif kind == "unlinked":
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.unlink(path)
else:
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
os.ftruncate(fd, 4096)
flags = mmap.MAP_PRIVATE if kind == "private" else mmap.MAP_SHARED
prot = mmap.PROT_READ if kind == "readonly" else mmap.PROT_READ | mmap.PROT_WRITE
m = mmap.mmap(fd, 4096, flags=flags, prot=prot)
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("kind, risky", [("shared", True), ("memfd", False),
                                         ("unlinked", False), ("private", False),
                                         ("readonly", False)])
def test_only_a_regular_file_mapped_shared_and_writable_counts(tmp_path, kind, risky):
    child = subprocess.Popen([sys.executable, "-c", MAPPER, kind, str(tmp_path / "f")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert writable_shared_maps([child.pid]) is risky
    finally:
        child.kill()
        child.wait()


def test_a_process_gone_is_skipped():
    child = subprocess.Popen(["true"])
    child.wait()
    assert writable_shared_maps([child.pid]) is False

