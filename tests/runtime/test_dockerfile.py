"""Building Dockerfiles on the engine: multi-stage COPY --from, ARG/ENV/WORKDIR/USER,
ADD of a tarball, COPY as root and as the sandbox user, apt-get in RUN (from the host's
Debian mirror, as the builtin images do), cached rebuilds, and refused instructions
named by their line."""

from __future__ import annotations

import io
import secrets
import tarfile

import pytest

from corral.errors import DockerfileError, InvalidArgument
from corral.runtime.dockerfile import parse_dockerfile
from corral.runtime.dockerfile_build import build_dockerfile, stage_name
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(900)]

DOCKERFILE = """\
# a two-stage build
ARG BASE=python
FROM ${BASE} AS build
ARG GREETING=hello
RUN mkdir -p /opt/out && echo "$GREETING from the build stage" > /opt/out/msg.txt
RUN ["/bin/sh", "-c", "echo exec form > /opt/out/exec.txt"]

FROM $BASE
ARG VERSION=1
ENV APP_VERSION=v${VERSION} MODE="fast mode"
LABEL org.example.task="demo" maintainer=corral
WORKDIR /app
COPY --from=build /opt/out/ /app/out/
COPY src/ ./src/
ADD data.tar.gz /app/data/
RUN apt-get update -q && apt-get install -y -q --no-install-recommends jq && jq --version
WORKDIR /home/sandbox/work
USER sandbox
RUN echo "$APP_VERSION $MODE $(id -u)" > note.txt
COPY --chown=sandbox notes.txt ./
EXPOSE 8000
CMD ["python3", "-m", "http.server"]
"""


@pytest.fixture
def context(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src/main.py").write_text("print('main')\n")
    (tmp_path / "notes.txt").write_text("the sandbox user's\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"from the tarball\n"
        info = tarfile.TarInfo("inner/data.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (tmp_path / "data.tar.gz").write_bytes(buf.getvalue())
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    return tmp_path


@pytest.fixture
def name(engine):
    made = f"t-df-{secrets.token_hex(4)}"
    yield made
    for n in (made, stage_name(made, 0)):
        if engine.images.exists(n):
            engine.images.remove(n)


async def sh(engine, sid: str, cmd: str) -> str:
    r = await engine.exec(sid, cmd)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


async def test_multi_stage_dockerfile_builds_and_runs(engine, context, name):
    events = []
    result = await build_dockerfile(engine, context, name=name, build_args={"VERSION": "7"},
                                    on_event=events.append)
    image = result.image
    assert image.workdir == "/home/sandbox/work"
    assert image.env["APP_VERSION"] == "v7" and image.env["MODE"] == "fast mode"
    manifest = engine.images.manifest(name)
    assert manifest["cmd"] == ["python3", "-m", "http.server"]
    assert manifest["labels"] == {"org.example.task": "demo", "maintainer": "corral"}
    assert manifest["expose"] == ["8000"] and manifest["user"] == "sandbox"
    sb = await engine.create(image=name)
    try:
        assert await sh(engine, sb.id, "pwd") == "/home/sandbox/work\n"
        assert await sh(engine, sb.id, "cat note.txt") == "v7 fast mode 1000\n"
        assert await sh(engine, sb.id, "cat /app/out/msg.txt") == \
            "hello from the build stage\n"
        assert await sh(engine, sb.id, "cat /app/out/exec.txt") == "exec form\n"
        assert await sh(engine, sb.id, "cat /app/src/main.py") == "print('main')\n"
        assert await sh(engine, sb.id, "cat /app/data/inner/data.txt") == "from the tarball\n"
        assert (await sh(engine, sb.id, "jq -n 1")).strip() == "1"
        # root's files are the sandbox's root's (docs/users.md): not the sandbox user's
        owners = await sh(engine, sb.id, "stat -c %U /app/src/main.py notes.txt")
        assert owners.split() == ["root", "sandbox"]
        assert "Permission denied" in (await engine.exec(
            sb.id, "echo x > /app/src/main.py")).stderr.decode()
    finally:
        await engine.delete(sb.id)
    # unchanged: every step cached; one changed ARG: only what follows it runs again
    again = await build_dockerfile(engine, context, name=name, build_args={"VERSION": "7"})
    assert again.stats.built == 0 and again.image.digest == image.digest
    # content no other build has had: the layer cache is shared and content-addressed,
    # so a fixed "changed" may already be cached by this test's run in another checkout
    (context / "notes.txt").write_text(f"changed {secrets.token_hex(8)}\n")
    third = await build_dockerfile(engine, context, name=name, build_args={"VERSION": "7"})
    assert third.stats.built == 1


async def test_user_workdir_env_and_entrypoint_apply_at_run_time(engine, tmp_path, name):
    """USER root, WORKDIR and ENV are the defaults of exec; ``run_entrypoint`` starts
    ENTRYPOINT + CMD in the background on create, as that user, there, with that env."""
    (tmp_path / "Dockerfile").write_text(
        "FROM python\nENV GREETING=hi\nWORKDIR /srv/app\nUSER root\n"
        'ENTRYPOINT ["/bin/sh", "-c"]\n'
        'CMD ["echo $GREETING $(id -u) $(pwd) > /srv/app/started; exec sleep 300"]\n')
    await build_dockerfile(engine, tmp_path, name=name)
    sb = await engine.create(image=name, run_entrypoint=True)
    try:
        got = await sh(engine, sb.id, "for i in $(seq 100); do test -s started && break; "
                       "sleep 0.1; done; cat started; id -u; echo $GREETING")
        assert got == "hi 0 /srv/app\n0\nhi\n"
        (proc,) = engine.list_processes(sb.id)
        assert proc.argv[-1].endswith("exec sleep 300")
        assert await sh(engine, sb.id, "id -u") == "0\n"  # USER root: exec's default
        r = await engine.exec(sb.id, "id -u", user="sandbox")
        assert r.stdout == b"1000\n"
    finally:
        await engine.delete(sb.id)
    with pytest.raises(InvalidArgument, match="no ENTRYPOINT or CMD"):
        await engine.create(image="python", run_entrypoint=True)


@pytest.mark.parametrize("text,line,word", [
    ("FROM python\nRUN true\nHEALTHCHECK CMD true\n", 3, "HEALTHCHECK"),
    ("FROM python\nVOLUME /data\n", 2, "VOLUME"),
    ("FROM python\n\nONBUILD RUN true\n", 3, "ONBUILD"),
    ("FROM python\nRUN --mount=type=secret,id=x cat /run/secrets/x\n", 2, "RUN"),
    ("FROM python\nRUN <<EOF\necho hi\nEOF\n", 2, "heredoc"),
    ("FROM python\nUSER nobody\nRUN true\n", 3, "USER nobody"),
    ("FROM python\nADD https://example.invalid/x /x\n", 2, "URLs"),
    ("FROM python\nCOPY --chmod=755 a /a\n", 2, "--chmod"),
    ("FROM python\nSHELL [\"/bin/bash\", \"-c\"]\n", 2, "SHELL"),
    ("FROM python:3.12\n", 1, "HOST"),
    ("RUN true\n", 1, "before the first FROM"),
])
def test_unsupported_instructions_are_named_with_their_line(text, line, word):
    with pytest.raises(DockerfileError) as info:
        parse_dockerfile(text)
    assert f"line {line}:" in info.value.message and word in info.value.message
    assert info.value.details["line"] == line
