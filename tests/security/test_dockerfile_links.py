"""A hostile Dockerfile (runtime/dockerfile_build.py): ``COPY --from`` a stage whose
source is a symbolic link to a host path.

The stage's files were exported to the host as they are, a link as a link, and the
copy step then read its source on the host following a link given as the source itself
(like ``cp``): ``RUN ln -s /etc/shadow /x`` in one stage and ``COPY --from=0 /x /y`` in
the next copied the host's file, read as root, into the tenant's image. A source that
is a link is now followed inside the image (as Docker does), so it names the image's
file or nothing.
"""

from __future__ import annotations

import os
import secrets
import tempfile

import pytest

from corral.errors import ImageBuildError
from corral.runtime.dockerfile_build import build_dockerfile, stage_name
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


@pytest.fixture
def name(engine):
    made = f"t-dflink-{secrets.token_hex(4)}"
    yield made
    for n in (made, stage_name(made, 0)):
        if engine.images.exists(n):
            engine.images.remove(n)


async def test_copy_from_a_stage_never_reads_a_host_file_a_link_names(engine, tmp_path, name):
    secret = "corral-host-secret-" + secrets.token_hex(8)
    fd, host_file = tempfile.mkstemp(prefix="corral-host-")
    os.write(fd, secret.encode())
    os.close(fd)
    try:
        (tmp_path / "Dockerfile").write_text(
            f"FROM python AS a\nRUN ln -s {host_file} /evil\n"
            "FROM python\nCOPY --from=a /evil /stolen\nRUN chmod 644 /stolen\n")
        with pytest.raises(ImageBuildError, match="does not exist"):  # not in the image
            await build_dockerfile(engine, tmp_path, name=name)
    finally:
        os.unlink(host_file)


async def test_a_link_as_the_source_is_followed_inside_the_image(engine, tmp_path, name):
    (tmp_path / "Dockerfile").write_text(
        "FROM python AS a\nRUN mkdir -p /d/in && echo mine > /d/in/f && ln -s /d/in/f /lf"
        " && ln -s /d /ld && ln -s /nowhere /d/dangling\n"
        "FROM python\nCOPY --from=a /lf /app/f\nCOPY --from=a /ld/ /app/d/\n")
    await build_dockerfile(engine, tmp_path, name=name)
    sb = await engine.create(image=name, memory_mb=128)
    r = await engine.exec(sb.id, "cat /app/f /app/d/in/f; readlink /app/d/dangling")
    assert r.stdout.decode().split() == ["mine", "mine", "/nowhere"], r.stderr
    await engine.delete(sb.id)
