"""``sb.files`` end to end."""

from __future__ import annotations

import os

import pytest

import corral


@pytest.fixture
def sb(client):
    with corral.Sandbox.create(client=client) as sandbox:
        yield sandbox


def test_write_read_list_stat_remove(sb):
    sb.files.write("/app/solution.py", b"print(1)\n")
    sb.files.write("notes.txt", "héllo")  # relative to the workdir, str as UTF-8
    assert sb.files.read("/app/solution.py") == b"print(1)\n"
    assert sb.files.read("/workspace/notes.txt") == "héllo".encode()
    assert sb.exec(["python3", "/app/solution.py"]).stdout == "1\n"

    entries = sb.files.list("/app")
    assert [(e.name, e.path, e.size, e.is_dir) for e in entries] == [
        ("solution.py", "/app/solution.py", 9, False)]
    info = sb.files.stat("/app")
    assert info.is_dir and isinstance(info, corral.FileInfo)
    assert sb.files.exists("/app/solution.py") and not sb.files.exists("/app/missing")

    sb.files.mkdir("/data/a/b")
    assert sb.files.stat("/data/a/b").is_dir
    sb.files.mkdir("/data/a/b")  # again: it is there, fine
    with pytest.raises(corral.FileError, match="exists"):
        sb.files.mkdir("/app/solution.py")  # a regular file is not a directory
    with pytest.raises(corral.FileError):
        sb.files.remove("/data")  # not empty
    sb.files.remove("/data", recursive=True)
    assert not sb.files.exists("/data")


def test_modes(sb):
    sb.files.write("/app/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sb.files.stat("/app/run.sh").mode == 0o755
    assert sb.exec("/app/run.sh").stdout == "ran\n"


def test_upload_and_download_a_large_local_file(sb, tmp_path):
    data = os.urandom(3 * (1 << 20) + 17)
    local = tmp_path / "blob.bin"
    local.write_bytes(data)
    os.chmod(local, 0o600)
    sb.files.upload(local, "/data/blob.bin")
    assert sb.files.stat("/data/blob.bin").size == len(data)
    assert sb.files.stat("/data/blob.bin").mode == 0o600  # the local mode by default
    assert sb.exec("sha256sum /data/blob.bin").stdout.split()[0] == __import__("hashlib").sha256(data).hexdigest()
    out = sb.files.download("/data/blob.bin", tmp_path / "back.bin")
    assert out.read_bytes() == data
    assert sb.files.read("/data/blob.bin") == data


def test_file_errors_are_typed(sb):
    with pytest.raises(corral.FileNotFound) as info:
        sb.files.read("/nope/missing.txt")
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        sb.files.stat("missing")
    with pytest.raises(corral.PathOutsideSandbox) as info:
        sb.files.read("../../../etc/passwd")
    assert isinstance(info.value, ValueError)
    with pytest.raises(corral.FileError):
        sb.files.write("/etc/passwd", "x")  # the image is read-only
