"""Red team: a directory sent as a volume's archive (client/_tarstream.py) by a client
that can read more than whoever else writes in that directory (a root data-prep job, a
shared dataset directory). A file swapped for a link to a secret after its header was
made was opened through the link: the secret's bytes went into the volume under the
file's name. Now a file's header and bytes come from the one inode opened, never
through a link."""

from __future__ import annotations

import os
import tarfile

from corral.client import _tarstream


def test_a_file_swapped_for_a_link_mid_archive_sends_no_bytes_of_its_target(tmp_path,
                                                                          monkeypatch):
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * 100)  # as long as the file, so the sizes agree
    src = tmp_path / "src"
    src.mkdir()
    (src / "data").write_bytes(b"d" * 100)
    real = tarfile.TarFile.gettarinfo

    def swapping(self, name=None, arcname=None, fileobj=None):
        info = real(self, name, arcname, fileobj)
        if arcname == "data":  # the other writer's move, right after the header is made
            os.unlink(src / "data")
            os.symlink(secret, src / "data")
        return info

    monkeypatch.setattr(tarfile.TarFile, "gettarinfo", swapping)
    archive = tmp_path / "a.tar"
    archive.write_bytes(b"".join(_tarstream.tar_pieces(src)))
    monkeypatch.undo()
    assert b"SSSS" not in archive.read_bytes()
    with tarfile.open(archive) as tar:
        member = tar.getmember("data")
        assert not member.isreg() or tar.extractfile(member).read() == b"d" * 100
