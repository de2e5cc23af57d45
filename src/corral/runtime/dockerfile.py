"""Building Dockerfiles: each stage becomes a build spec run by :mod:`.image_build`.

The Dockerfile is parsed by ``dockerfile-parse`` (the parser Harbor's own backends
use); each instruction maps onto the declarative build's steps, so each is a cached
layer like any build step:

=============  ===========================================================================
FROM           a registry reference (pulled on first use), a corral image, an earlier
               stage (``AS name`` or its number), or ``scratch``
RUN            shell or exec form; as root of the build's user namespace
               (:mod:`.rootbuild`), or as the sandbox user after ``USER sandbox``/``1000``;
               ``ARG`` values are in its environment
COPY, ADD      from the context (``.dockerignore`` applied by the client that sent it),
               ``--from=stage|image``, ``--chown=root|0|sandbox|1000``; ``ADD`` of a
               local tar archive (plain, gzip, bzip2, xz) unpacks it
ENV, ARG       ``$VAR``/``${VAR}``/``${VAR:-default}`` expanded in later instructions
               (``--build-arg`` values override ARG defaults)
WORKDIR        made (``mkdir -p``) and the default working directory of later steps
               and of sandboxes
USER           who later ``RUN`` steps run as; sandboxes always run as the sandbox user
LABEL, CMD, ENTRYPOINT, EXPOSE, STOPSIGNAL, MAINTAINER
               recorded in the image's manifest
=============  ===========================================================================

Anything else (``HEALTHCHECK``, ``ONBUILD``, ``VOLUME``, ``SHELL``, heredocs, ``RUN
--mount``/``--network``, ``ADD`` of a URL, ``COPY --chmod``, another user) is refused
with :class:`~corral.errors.DockerfileError` naming its line, before any work.
"""

from __future__ import annotations

import glob
import io
import json
import os
import posixpath
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import DockerfileError, InvalidArgument
from corral.image_schema import BuildEvent, validate_image_name
from corral.runtime.distribution import is_reference
from corral.runtime.image_pull import SCRATCH

MAX_EXPORT_BYTES = 4 << 30
ROOT_USERS = ("", "root", "0", "root:root", "0:0")
SANDBOX_USERS = ("sandbox", "1000", "sandbox:sandbox", "1000:1000")
_META = ("LABEL", "CMD", "ENTRYPOINT", "EXPOSE", "STOPSIGNAL", "MAINTAINER")
_REFUSED = {
    "HEALTHCHECK": "health checks (corral watches its sandboxes itself)",
    "ONBUILD": "ONBUILD triggers",
    "VOLUME": "volumes (a sandbox's files are its own; copy data in instead)",
    "SHELL": "another shell (RUN uses /bin/sh -c)",
}
_VAR_RE = re.compile(r"\\\$|\$(?:\{(\w+)(?::?([-+])([^}]*))?\}|(\w+))")
_FLAG_RE = re.compile(r"--([a-z-]+)(?:=(\S*))?$")

OnEvent = Callable[[BuildEvent], Any]


@dataclass
class Source:
    """Where a COPY/ADD takes its files: the context, an earlier stage or an image
    (``image``), unpacked from a tar (``unpack``)."""

    path: str
    image: str | None = None
    stage: int | None = None
    unpack: bool = False


@dataclass
class Stage:
    index: int
    base: str  # a reference, an image name, "scratch", or "stage:<n>"
    alias: str | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    sources: dict[int, Source] = field(default_factory=dict)  # step index -> source
    meta: dict[str, Any] = field(default_factory=dict)


def parse_dockerfile(text: str, build_args: dict[str, str] | None = None,
                     context: Path | None = None) -> list[Stage]:
    """The stages of a Dockerfile, or :class:`DockerfileError` naming a line."""
    from dockerfile_parse import DockerfileParser  # type: ignore[import-untyped]

    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    build_args = dict(build_args or {})
    globals_: dict[str, str] = {}
    stages: list[Stage] = []
    for item in parser.structure:
        ins, value, line = item["instruction"].upper(), item["value"], item["startline"] + 1
        if ins == "COMMENT":
            continue
        if not stages:
            if ins == "ARG":
                for k, v in _args(value, line):
                    globals_[k] = build_args.get(k, _expand(v, globals_, line) if v else "")
                continue
            if ins != "FROM":
                raise DockerfileError(f"line {line}: {ins} before the first FROM",
                                      details={"line": line, "instruction": ins})
        if ins == "FROM":
            stages.append(_from(value, line, globals_, stages))
            continue
        _Translator(stages[-1], stages, build_args, globals_, context).add(ins, value, line)
    if not stages:
        raise DockerfileError("the Dockerfile has no FROM", details={"line": 0})
    return stages


def _from(value: str, line: int, args: dict[str, str], stages: list[Stage]) -> Stage:
    words = _expand(value, args, line).split()
    words = [w for w in words if not w.startswith("--platform=")]
    alias = None
    if len(words) == 3 and words[1].lower() == "as":
        alias = words[2].lower()
    elif len(words) != 1:
        raise DockerfileError(f"line {line}: write FROM IMAGE [AS NAME], not FROM {value}",
                              details={"line": line, "instruction": "FROM"})
    base = words[0]
    known = {s.alias: s.index for s in stages if s.alias}
    if base.lower() in known:
        base = f"stage:{known[base.lower()]}"
    elif base != SCRATCH and not is_reference(base):
        try:
            validate_image_name(base)
        except InvalidArgument:
            raise DockerfileError(
                f"line {line}: FROM {base}: name a registry image with its host "
                "(HOST[:PORT]/REPO[:TAG]), a corral image, an earlier stage or scratch",
                details={"line": line, "instruction": "FROM"}) from None
    stage = Stage(len(stages), base, alias)
    stage.meta["_args"] = {}  # ARGs of this stage (names -> values), for RUN
    stage.meta["_user"] = "root"
    return stage


class _Translator:
    """Adds one instruction of a stage as build steps."""

    def __init__(self, stage: Stage, stages: list[Stage], build_args: dict[str, str],
                 globals_: dict[str, str], context: Path | None) -> None:
        self.stage, self.stages, self.build_args = stage, stages, build_args
        self.globals, self.context = globals_, context

    @property
    def vars(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for step in self.stage.steps:
            env.update(step.get("env") or {})
        return {**env, **self.stage.meta["_args"]}

    def fail(self, line: int, ins: str, why: str) -> DockerfileError:
        return DockerfileError(f"line {line}: {ins}: {why}",
                               details={"line": line, "instruction": ins})

    def add(self, ins: str, value: str, line: int) -> None:
        if ins in _REFUSED:
            raise self.fail(line, ins, f"corral does not support {_REFUSED[ins]}")
        handler = getattr(self, f"_{ins.lower()}", None)
        if ins in _META:
            self._meta(ins, value, line)
        elif handler is None:
            raise self.fail(line, ins, "unknown instruction")
        else:
            handler(value, line)

    def _arg(self, value: str, line: int) -> None:
        for k, v in _args(value, line):
            if k in self.build_args:
                got = self.build_args[k]
            elif v is not None:
                got = _expand(v, {**self.globals, **self.vars}, line)
            else:
                got = self.globals.get(k, "")
            self.stage.meta["_args"][k] = got

    def _env(self, value: str, line: int) -> None:
        pairs = _pairs(value, line, "ENV", {**self.globals, **self.vars})
        if pairs:
            self.stage.steps.append({"env": pairs})

    def _run(self, value: str, line: int) -> None:
        if value.lstrip().startswith("--"):
            raise self.fail(line, "RUN", f"flags ({value.split()[0]}) are not supported")
        if "<<" in value.split("\n", 1)[0] and re.search(r"<<-?\s*['\"]?\w+", value):
            raise self.fail(line, "RUN", "heredocs are not supported: write the file "
                            "with COPY, or use a shell command")
        command = _exec_form(value)
        cmd = shlex.join(command) if command is not None else value
        args = self.stage.meta["_args"]
        if args:
            cmd = "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in args.items()) + \
                "; " + cmd
        self.stage.steps.append({"run": cmd, **self._as(line, "RUN")})

    def _as(self, line: int, ins: str) -> dict[str, str]:
        user = self.stage.meta["_user"]
        if user in ROOT_USERS:
            return {"user": "root"}
        if user in SANDBOX_USERS:
            return {}
        raise self.fail(line, ins, f"USER {user}: corral builds as root or as the sandbox "
                        "user (sandbox, uid 1000) only")

    def _workdir(self, value: str, line: int) -> None:
        path = _expand(value.strip(), {**self.globals, **self.vars}, line)
        current = self._current_workdir()
        path = posixpath.normpath(posixpath.join(current, path))
        self.stage.steps.append({"run": f"mkdir -p {shlex.quote(path)}", **self._as(line,
                                                                                    "WORKDIR")})
        self.stage.steps.append({"workdir": path})

    def _current_workdir(self) -> str:
        for step in reversed(self.stage.steps):
            if "workdir" in step:
                return str(step["workdir"])
        return "/"

    def _user(self, value: str, line: int) -> None:
        user = _expand(value.strip(), {**self.globals, **self.vars}, line)
        self.stage.meta["_user"] = user
        self.stage.meta["user"] = user

    def _copy(self, value: str, line: int, ins: str = "COPY") -> None:
        words = _words(_expand(value, {**self.globals, **self.vars}, line), line, ins)
        flags: dict[str, str] = {}
        while words and words[0].startswith("--"):
            m = _FLAG_RE.match(words.pop(0))
            if m is None:
                raise self.fail(line, ins, "a malformed flag")
            flags[m[1]] = m[2] or ""
        unknown = set(flags) - {"from", "chown", "link"}
        if unknown:
            raise self.fail(line, ins, f"--{sorted(unknown)[0]} is not supported")
        if len(words) < 2:
            raise self.fail(line, ins, "needs a source and a destination")
        *srcs, dest = words
        chown = flags.get("chown", "")
        if chown in ROOT_USERS:
            user = {"user": "root"}
        elif chown in SANDBOX_USERS:
            user = {}
        else:
            raise self.fail(line, ins, f"--chown={chown}: only root (0) or the sandbox "
                            "user (sandbox, 1000)")
        if len(srcs) > 1 and not dest.endswith("/"):
            raise self.fail(line, ins, "with several sources the destination ends with /")
        frm = flags.get("from")
        image = stage = None
        if frm is not None:
            known = {s.alias: s.index for s in self.stages[:-1] if s.alias}
            if frm.lower() in known:
                stage = known[frm.lower()]
            elif frm.isdecimal() and int(frm) < self.stage.index:
                stage = int(frm)
            else:
                image = frm
        for src in srcs:
            if ins == "ADD" and re.match(r"[a-z]+://", src):
                raise self.fail(line, ins, "URLs are not supported: download in a RUN step")
            for one in self._expand_glob(src, frm, line, ins):
                unpack = ins == "ADD" and frm is None and _is_tar(self.context, one)
                dest_one = dest
                self.stage.sources[len(self.stage.steps)] = Source(one, image, stage, unpack)
                self.stage.steps.append({"copy": {"src": one, "dest": dest_one}, **user})

    def _add(self, value: str, line: int) -> None:
        self._copy(value, line, "ADD")

    def _expand_glob(self, src: str, frm: str | None, line: int, ins: str) -> list[str]:
        if not any(c in src for c in "*?["):
            return [src]
        if frm is not None or self.context is None:
            raise self.fail(line, ins, f"wildcards in --from sources are not supported: {src}")
        found = sorted(os.path.relpath(p, self.context) for p in glob.glob(
            str(self.context / src)))
        if not found:
            raise self.fail(line, ins, f"no file of the context matches {src}")
        return found

    def _meta(self, ins: str, value: str, line: int) -> None:
        meta = self.stage.meta
        expanded = _expand(value, {**self.globals, **self.vars}, line)
        if ins == "LABEL" or ins == "MAINTAINER":
            labels = meta.setdefault("labels", {})
            if ins == "MAINTAINER":
                labels["maintainer"] = expanded.strip()
            else:
                labels.update(_pairs(value, line, ins, {**self.globals, **self.vars}))
        elif ins in ("CMD", "ENTRYPOINT"):
            command = _exec_form(value)
            meta[ins.lower()] = command if command is not None else ["/bin/sh", "-c", value]
        elif ins == "EXPOSE":
            meta.setdefault("expose", []).extend(expanded.split())
        else:
            meta["stopsignal"] = expanded.strip()


def _exec_form(value: str) -> list[str] | None:
    text = value.strip()
    if not text.startswith("["):
        return None
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    if isinstance(parsed, list) and parsed and all(isinstance(x, str) for x in parsed):
        return parsed
    return None


def _expand(text: str, env: dict[str, str], line: int) -> str:
    def sub(m: re.Match[str]) -> str:
        if m[0] == "\\$":
            return "$"
        name = m[1] or m[4]
        have = env.get(name)
        if m[2] == "-":
            return have if have else m[3]
        if m[2] == "+":
            return m[3] if have else ""
        return have or ""

    return _VAR_RE.sub(sub, text)


def _words(text: str, line: int, ins: str) -> list[str]:
    command = _exec_form(text)
    if command is not None:
        return command
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise DockerfileError(f"line {line}: {ins}: {exc}",
                              details={"line": line, "instruction": ins}) from None


def _args(value: str, line: int) -> list[tuple[str, str | None]]:
    out = []
    for word in _words(value, line, "ARG"):
        k, sep, v = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise DockerfileError(f"line {line}: ARG: invalid name {k!r}",
                                  details={"line": line, "instruction": "ARG"})
        out.append((k, v if sep else None))
    return out


def _pairs(value: str, line: int, ins: str, env: dict[str, str]) -> dict[str, str]:
    words = _words(value, line, ins)
    if words and "=" not in words[0]:  # the old form: ENV KEY value with spaces
        return {words[0]: _expand(" ".join(words[1:]), env, line)}
    pairs: dict[str, str] = {}
    for word in words:
        k, sep, v = word.partition("=")
        if not sep or not k:
            raise DockerfileError(f"line {line}: {ins}: write KEY=VALUE, not {word!r}",
                                  details={"line": line, "instruction": ins})
        pairs[k] = _expand(v, {**env, **pairs}, line)
    return pairs


def _is_tar(context: Path | None, src: str) -> bool:
    if context is None:
        return False
    path = context / src
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):
        return True
    return len(head) >= 262 and head[257:262] == b"ustar"
