"""SandboxFusion's request and response models, and how its languages map onto images.

Contract checked against SandboxFusion's server (``sandbox/server/sandbox_api.py`` and
``sandbox/runners``), the ``sandbox-fusion`` client 0.3.7 and verl's reward code
(``verl/utils/reward_score/sandbox_fusion``, which adds ``memory_limit_MB``):

- ``RunCodeRequest``: ``code``, ``language``, ``compile_timeout`` / ``run_timeout``
  (seconds, default 10), ``memory_limit_MB`` (-1: the default), ``stdin``, ``files``
  (path → base64, ``None`` skipped), ``fetch_files`` (paths), ``args`` (pytest's).
  Fields the server does not know are ignored, as its FastAPI models do.
- ``RunCodeResponse``: ``status`` (``Success`` / ``Failed`` / ``SandboxError``),
  ``message``, ``compile_result`` and ``run_result`` (``status`` ``Finished`` /
  ``Error`` / ``TimeLimitExceeded``, ``execution_time``, ``return_code``, ``stdout``,
  ``stderr``), ``executor_pod_name``, ``files`` (path → base64).
- Bad input is answered as FastAPI does: 422 ``{"detail": [{"type", "loc", "msg"}]}``.

**Settings** (environment variables of the daemon, read once when it starts):

- ``CORRAL_FUSION_IMAGES``: ``language=image`` pairs separated by commas, over the
  defaults of :data:`DEFAULT_IMAGES` (``python``/``bash``/``perl`` → ``python``;
  ``cpp``/``nodejs``/``js``/``pytest`` → ``fusion``), e.g. ``go=my-go,rust=my-rust``. The image
  must provide the toolchain :data:`LANGUAGES` runs.
- ``CORRAL_FUSION_WARM`` (default 4): ready sandboxes each of the front-end's warm
  pools keeps (one pool per image and memory size in use, made on first use).
- ``CORRAL_FUSION_POOL_IDLE`` (seconds, default 300): a pool no request used for
  that long is deleted with its ready sandboxes (at most 8 pools exist at once).
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corral.errors import InvalidArgument
from corral.runtime.prepare import FUSION_IMAGE  # built there (scripts/install.sh runs it)
from corral.schema import ExecResult

# Every language SandboxFusion's server or its 0.3.7 client names (its ``Language``).
Language = Literal[
    "python", "python2", "cpp", "nodejs", "js", "go", "go_test", "java", "php", "csharp",
    "bash", "typescript", "ts", "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby",
    "scala", "julia", "pytest", "junit", "kotlin_script", "jest", "verilog", "python_gpu",
    "lean", "swift", "racket", "gtest", "react",
]

DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 900.0  # compile_timeout, run_timeout, total_timeout: each at most this
MAX_FILES = 1000
MAX_OUTPUT = 1 << 20  # bytes kept of each stream, like SandboxFusion's runner (head only)
MAX_FETCH_BYTES = 64 << 20  # a fetched file bigger than this is an error, not a silent cut
DEFAULT_WARM = 4
DEFAULT_POOL_IDLE_S = 300.0


@dataclass(frozen=True)
class Toolchain:
    """How one language runs: the code goes to ``SOURCE`` (a fresh name ending in
    ``ext``) in the working directory; ``compile`` (if any) then ``run`` are argv
    lists in which ``{src}`` stands for that file's name."""

    ext: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    tool: str = ""  # what an image must provide, for the message when none does

    def argv(self, which: tuple[str, ...], src: str) -> list[str]:
        return [a.replace("{src}", src) for a in which]


# SandboxFusion's own commands (sandbox/runners/major.py), with python3 for `python`.
LANGUAGES: dict[str, Toolchain] = {
    "python": Toolchain(".py", ("python3", "{src}"), tool="python3"),
    "pytest": Toolchain(".py", ("python3", "-m", "pytest", "{src}"), tool="pytest"),
    "bash": Toolchain(".sh", ("/bin/bash", "{src}"), tool="bash"),
    "cpp": Toolchain(
        ".cpp", ("./test",), ("g++", "-std=c++17", "{src}", "-o", "test", "-lpthread"), "g++"
    ),
    "nodejs": Toolchain(".js", ("node", "{src}"), tool="node"),
    "js": Toolchain(".js", ("node", "{src}"), tool="node"),
    "go": Toolchain(".go", ("./out",), ("go", "build", "-o", "out", "{src}"), "go"),
    "rust": Toolchain(".rs", ("./test",), ("rustc", "{src}", "-o", "test"), "rustc"),
    "php": Toolchain(".php", ("php", "-f", "{src}"), tool="php"),
    "lua": Toolchain(".lua", ("lua", "{src}"), tool="lua"),
    "perl": Toolchain(".pl", ("perl", "{src}"), tool="perl"),
    "ruby": Toolchain(".rb", ("ruby", "{src}"), tool="ruby"),
    "R": Toolchain(".R", ("Rscript", "{src}"), tool="Rscript"),
    "julia": Toolchain(".jl", ("julia", "{src}"), tool="julia"),
}

DEFAULT_IMAGES: dict[str, str] = {
    "python": "python", "pytest": FUSION_IMAGE, "bash": "python", "perl": "python",
    "cpp": FUSION_IMAGE, "nodejs": FUSION_IMAGE, "js": FUSION_IMAGE,
}


@dataclass(frozen=True)
class FusionSettings:
    """The front-end's configuration (see the module docstring)."""

    images: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_IMAGES))
    warm: int = DEFAULT_WARM
    pool_idle: float = DEFAULT_POOL_IDLE_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "FusionSettings":
        """Settings from ``CORRAL_FUSION_*``; :class:`InvalidArgument` if one is
        malformed (the daemon then refuses to start, saying which)."""
        images = dict(DEFAULT_IMAGES)
        for pair in filter(None, (p.strip() for p in environ.get("CORRAL_FUSION_IMAGES", "").split(","))):
            lang, sep, image = (s.strip() for s in pair.partition("="))
            if not sep or lang not in LANGUAGES or not image:
                raise InvalidArgument(
                    f"invalid CORRAL_FUSION_IMAGES entry {pair!r}: use language=image pairs "
                    f"separated by commas, languages among {', '.join(sorted(LANGUAGES))}"
                )
            images[lang] = image
        raw = environ.get("CORRAL_FUSION_WARM", "").strip() or str(DEFAULT_WARM)
        if not raw.isdecimal() or int(raw) > 64:
            raise InvalidArgument(f"invalid CORRAL_FUSION_WARM {raw!r}: a whole number 0-64")
        idle = environ.get("CORRAL_FUSION_POOL_IDLE", "").strip() or str(DEFAULT_POOL_IDLE_S)
        try:
            pool_idle = float(idle)
        except ValueError:
            pool_idle = -1.0
        if not 0.1 <= pool_idle <= 86400:
            raise InvalidArgument(f"invalid CORRAL_FUSION_POOL_IDLE {idle!r}: seconds, "
                                  "0.1-86400")
        return cls(images=images, warm=int(raw), pool_idle=pool_idle)

    def missing(self, language: str) -> str:
        """Why ``language`` cannot run here, naming what to build."""
        chain = LANGUAGES.get(language)
        if chain is None:
            return (f"corral's SandboxFusion front-end does not run {language!r}: it runs "
                    f"{', '.join(sorted(LANGUAGES))}")
        return (f"no image provides {language!r} ({chain.tool}): build one with {chain.tool} "
                f"in it (corral image build) and map it with CORRAL_FUSION_IMAGES={language}=IMAGE "
                "on the daemon")

    def not_built(self, language: str, image: str) -> str:
        how = ("python -m corral.runtime.prepare (scripts/install.sh, `make install`, builds it)"
               if image == FUSION_IMAGE else "build it with corral image build")
        return f"{language!r} runs in image {image!r}, which this host does not have: {how}"


# ------------------------------------------------------------------- requests


class _Request(BaseModel):
    # SandboxFusion's FastAPI models ignore fields they do not know; so do these.
    model_config = ConfigDict(extra="ignore", frozen=True)

    memory_limit_MB: int = -1  # noqa: N815 (its wire name)
    files: dict[str, str | None] = Field(default_factory=dict, max_length=MAX_FILES)
    fetch_files: list[str] = Field(default_factory=list, max_length=MAX_FILES)


class RunCodeRequest(_Request):
    compile_timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    run_timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    code: str
    stdin: str | None = None
    language: Language
    args: list[str] = Field(default_factory=list, max_length=1000)


class RunJupyterRequest(_Request):
    cells: list[str] = Field(max_length=10_000)
    cell_timeout: float = Field(0, ge=0, le=MAX_TIMEOUT_S)
    total_timeout: float = Field(45, gt=0, le=MAX_TIMEOUT_S)
    kernel: Literal["python3"] = "python3"


def validation_detail(exc: ValidationError) -> list[dict[str, Any]]:
    """FastAPI's 422 ``detail`` for a body that does not fit (without the inputs)."""
    return [
        {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
        for e in exc.errors(include_url=False)
    ]


def decode_files(files: Mapping[str, str | None]) -> dict[str, bytes]:
    """The files to write, decoded; :class:`InvalidArgument` naming a bad one. Like
    SandboxFusion, a ``None`` content and a name with ``IGNORE_THIS_FILE`` are skipped."""
    out: dict[str, bytes] = {}
    for name, content in files.items():
        if content is None or "IGNORE_THIS_FILE" in name:
            continue
        if not name or "\0" in name:
            raise InvalidArgument(f"invalid file name {name!r} in files")
        try:
            out[name] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"files[{name!r}] is not base64") from None
    return out


# ------------------------------------------------------------------ responses

FINISHED, ERROR, TLE = "Finished", "Error", "TimeLimitExceeded"
SUCCESS, FAILED, SANDBOX_ERROR = "Success", "Failed", "SandboxError"


def command_result(r: ExecResult) -> dict[str, Any]:
    """A ``CommandRunResult``: a timeout has no return code; a signal is ``-N``."""
    return {
        "status": TLE if r.timed_out else FINISHED,
        "execution_time": r.duration,
        "return_code": None if r.timed_out else r.returncode,
        "stdout": r.stdout.decode("utf-8", "replace"),
        "stderr": r.stderr.decode("utf-8", "replace"),
    }


def run_status(*results: dict[str, Any] | None) -> str:
    """SandboxFusion's ``parse_run_status``: a time-out or non-zero exit fails the run."""
    done = [r for r in results if r is not None]
    if any(r["status"] == ERROR for r in done):
        return SANDBOX_ERROR
    if any(r["status"] == TLE or r["return_code"] != 0 for r in done):
        return FAILED
    return SUCCESS


def code_response(
    status: str, message: str = "", *, compile_result: dict[str, Any] | None = None,
    run_result: dict[str, Any] | None = None, files: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "status": status, "message": message, "compile_result": compile_result,
        "run_result": run_result, "executor_pod_name": None, "files": files or {},
    }


def jupyter_response(
    status: str, message: str = "", *, driver: dict[str, Any] | None = None,
    cells: list[dict[str, Any]] | None = None, files: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "status": status, "message": message, "driver": driver, "cells": cells or [],
        "executor_pod_name": None, "files": files or {},
    }


class CellResult(BaseModel):
    """One cell as the in-sandbox driver reports it (checked: the driver shares its
    process with the cells' code)."""

    model_config = ConfigDict(extra="forbid")

    stdout: str
    stderr: str
    display: list[dict[str, str]] = Field(max_length=1000)
    error: list[dict[str, Any]] = Field(max_length=100)


class DriverOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cells: list[CellResult] = Field(max_length=10_000)
