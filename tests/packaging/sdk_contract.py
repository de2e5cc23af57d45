"""The SDK contract an installed wheel must keep: run by tests/packaging/test_install.py
with a fresh virtualenv's Python (not this checkout's), against ``CORRAL_URL``.

Exits 0 and prints ``contract ok`` when every step held.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

import corral


def blocking() -> None:
    with corral.Sandbox.create(memory_mb=128, timeout=120, tags=["packaging"]) as sb:
        r = sb.exec(["python3", "-c", "print(6*7)"], timeout=30)
        assert (r.returncode, r.stdout) == (0, "42\n"), r
        sb.files.write("/workspace/a.txt", "héllo")
        assert sb.files.read("/workspace/a.txt") == "héllo".encode()
        assert [f.name for f in sb.files.list("/workspace")] == ["a.txt"]
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "big.bin"
            local.write_bytes(os.urandom(3 << 20))
            sb.files.upload(local, "/tmp/big.bin")
            back = sb.files.download("/tmp/big.bin", Path(tmp) / "back.bin")
            assert back.read_bytes() == local.read_bytes()
        try:
            sb.files.read("/workspace/missing")
        except corral.FileNotFound:
            pass
        else:
            raise AssertionError("a missing file must raise FileNotFound")
        sid = sb.id
    try:
        corral.Sandbox.connect(sid)
    except corral.SandboxNotFound:
        pass
    else:
        raise AssertionError("the sandbox must be gone once its block ends")


async def asynchronous() -> None:
    async with await corral.AsyncSandbox.create(memory_mb=128, timeout=120) as sb:
        r = await sb.exec("echo $X", env={"X": "async"})
        assert r.stdout == "async\n", r
        await sb.files.write("/tmp/b", b"\x00\xff")
        assert await sb.files.read("/tmp/b") == b"\x00\xff"


def main() -> int:
    assert os.environ.get("CORRAL_URL"), "set CORRAL_URL to the daemon under test"
    blocking()
    asyncio.run(asynchronous())
    print(f"contract ok: python {sys.version_info[0]}.{sys.version_info[1]}, "
          f"corral from {Path(corral.__file__).parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
