"""Images as the API sees them, and the declarative build spec.

Shared by the runtime (which builds), the server (which validates requests) and the
SDK (which reads spec files and packs what ``copy`` steps need). A spec is a base
image plus ordered steps, written in YAML (a JSON object is YAML too) or given as a
dict::

    name: my-env                  # the image's name (the CLI's --name wins)
    base: python                  # any image, built ones included
    steps:
      - run: pip install six==1.16.0        # a shell command, as the sandbox user
      - run: apt-get install -y g++         # as root in the build's user namespace
        user: root
      - copy: src/ -> /app/src              # from the host (relative: to the spec file)
      - env: {MODE: fast}                   # defaults for later steps and sandboxes
      - workdir: /app                       # likewise

``run`` steps get the network (``network="host"``), sandboxes made from the image do
not. Every step that changes files is cached by its content (see
:mod:`corral.runtime.image_build`).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Union

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    StrictFloat,
    StrictInt,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from corral._model import Model
from corral.errors import InvalidArgument
from corral.schema import DEFAULT_IMAGE, validate_model

MAX_STEPS = 64
MAX_COMMAND = 64 << 10  # characters of a run step
MAX_PATH = 4096  # characters of a path (copy source or destination, workdir)
MAX_ENV = 1024  # variables of one env step
DEFAULT_STEP_TIMEOUT_S = 1800.0
DEFAULT_BUILD_MEMORY_MB = 2048
DEFAULT_BUILD_DISK_MB = 8192
STEP_KINDS = ("run", "copy", "env", "workdir")
UPLOADED_ARCHIVE = "the uploaded archive"  # how import errors name the upload
IMAGE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STEP_NUMBER_RE = re.compile(r"[1-9][0-9]{0,3}")
_ARROW = "->"


def validate_image_name(name: str) -> str:
    """Return ``name`` if it is a valid image name, else raise :class:`InvalidArgument`."""
    if not isinstance(name, str) or not IMAGE_NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"invalid image name {name!r}: use 1-64 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            details={"image": name},
        )
    return name


class _Strict(Model):
    """Unknown fields refused; numbers strict (no ``"512"`` for 512, no ``true`` for 1);
    text and lists bounded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_Path = Annotated[str, Field(min_length=1, max_length=MAX_PATH)]


def _absolute(path: str) -> str:
    if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise ValueError(f"{path!r} must be an absolute path without '..', e.g. /app")
    return path.rstrip("/") or "/"


class RunStep(_Strict):
    """``run: <shell command>``: runs under ``/bin/sh -c`` in the image so far, as the
    sandbox user; with ``user: root``, as root of the build sandbox's user namespace
    (``apt-get install``: no host privilege, see :mod:`corral.runtime.rootbuild`)."""

    run: str = Field(min_length=1, max_length=MAX_COMMAND)
    user: Literal["root", "sandbox"] | None = None

    @property
    def as_root(self) -> bool:
        return self.user == "root"

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        data = handler(self)  # without user when unset: specs dump as they always did
        if isinstance(data, dict) and data.get("user") is None:
            data.pop("user", None)
        return data

    def describe(self) -> str:
        return f"run{' (as root)' if self.as_root else ''}: {self.run}"


class CopySource(_Strict):
    src: _Path
    dest: _Path

    @field_validator("dest")
    @classmethod
    def _dest(cls, v: str) -> str:
        if "\0" in v or ".." in v.split("/"):
            raise ValueError(f"copy destination {v!r} may not contain '..'")
        return v


class CopyStep(_Strict):
    """``copy: <src> -> <dest>``: a file or a directory's contents into the image. A
    relative ``dest`` starts at the workdir; a file copied to a ``dest`` ending in
    ``/`` keeps its name."""

    # ``copy`` is the key on the wire; as an attribute it would shadow BaseModel.copy.
    model_config = ConfigDict(serialize_by_alias=True)

    source: CopySource = Field(alias="copy")
    # root: written by root of the build's user namespace, owned by root in the image
    # (a Dockerfile's COPY); else by the sandbox user, owned by it
    user: Literal["root", "sandbox"] | None = None

    @property
    def as_root(self) -> bool:
        return self.user == "root"

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        data = handler(self)  # without user when unset: specs dump as they always did
        if isinstance(data, dict) and data.get("user") is None:
            data.pop("user", None)
        return data

    @field_validator("source", mode="before")
    @classmethod
    def _arrow(cls, v: Any) -> Any:
        if isinstance(v, str):
            src, sep, dest = v.partition(_ARROW)
            if not sep or not src.strip() or not dest.strip():
                raise ValueError(f"write copy as 'SRC -> DEST', got {v!r}")
            return {"src": src.strip(), "dest": dest.strip()}
        return v

    def describe(self) -> str:
        return (f"copy{' (as root)' if self.as_root else ''}: {self.source.src} -> "
                f"{self.source.dest}")


class EnvStep(_Strict):
    """``env: {K: V}``: environment for later steps and sandboxes made from the image."""

    env: dict[str, str] = Field(min_length=1, max_length=MAX_ENV)

    @field_validator("env")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        for k, x in v.items():
            if not _ENV_KEY_RE.match(k) or "\0" in x:
                raise ValueError(f"invalid environment variable name or value: {k!r}")
        return v

    def describe(self) -> str:
        return "env: " + " ".join(f"{k}={v}" for k, v in self.env.items())


class WorkdirStep(_Strict):
    """``workdir: /path``: the working directory of later steps and of sandboxes."""

    workdir: _Path

    @field_validator("workdir")
    @classmethod
    def _path(cls, v: str) -> str:
        return _absolute(v)

    def describe(self) -> str:
        return f"workdir: {self.workdir}"


def _step_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        return "run" if "run" in v else next(iter(v), None)
    return {RunStep: "run", CopyStep: "copy", EnvStep: "env", WorkdirStep: "workdir"}.get(
        type(v))


Step = Annotated[
    Union[
        Annotated[RunStep, Tag("run")],
        Annotated[CopyStep, Tag("copy")],
        Annotated[EnvStep, Tag("env")],
        Annotated[WorkdirStep, Tag("workdir")],
    ],
    Discriminator(_step_kind),
]


class BuildSpec(_Strict):
    """A declarative image build: ``base`` plus ``steps``, and the build sandbox's
    resources (which do not change what is built, so they are not part of the cache)."""

    name: str | None = None
    base: str = DEFAULT_IMAGE
    steps: list[Step] = Field(min_length=1, max_length=MAX_STEPS)
    step_timeout: StrictFloat = Field(DEFAULT_STEP_TIMEOUT_S, gt=0, le=86400)
    memory_mb: StrictInt = Field(DEFAULT_BUILD_MEMORY_MB, ge=64, le=1 << 20)
    disk_mb: StrictInt = Field(DEFAULT_BUILD_DISK_MB, ge=64, le=1 << 22)

    @field_validator("name", "base")
    @classmethod
    def _image_name(cls, v: str | None) -> str | None:
        if v is not None and not IMAGE_NAME_RE.fullmatch(v):
            raise ValueError(f"invalid image name {v!r}: use 1-64 of a-z, 0-9, '.', '_', '-'")
        return v

    @model_validator(mode="before")
    @classmethod
    def _step_kinds(cls, data: Any) -> Any:
        """One clear message per bad step, instead of pydantic's four union attempts."""
        if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
            return data
        for i, step in enumerate(data["steps"], 1):
            keys = list(step) if isinstance(step, dict) else []
            if ("run" in keys or "copy" in keys) and "user" in keys:  # ..., user: root
                keys.remove("user")
            if len(keys) != 1 or keys[0] not in STEP_KINDS:
                raise ValueError(
                    f"step {i} must be a mapping with exactly one of "
                    f"{', '.join(STEP_KINDS)}, got {step!r}"
                )
        return data

    @classmethod
    def parse(cls, data: Any) -> BuildSpec:
        """Validate a dict, raising :class:`InvalidArgument` that names the bad fields."""
        if isinstance(data, BuildSpec):
            return data
        return validate_model(cls, data, "image build spec")

    def describe(self, index: int) -> str:
        """The text of step ``index`` (0-based), for logs and errors."""
        return self.steps[index].describe()


def read_build_spec(path: str | Path) -> BuildSpec:
    """A spec from a YAML (or JSON) file; ``copy`` sources stay as written (see
    :func:`resolve_copy_sources` for the directory they are relative to)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the build spec {path}: {exc.strerror}",
                              details={"path": str(path)}) from None
    return parse_build_yaml(text, source=str(path))


def parse_build_yaml(text: str, *, source: str = "<spec>") -> BuildSpec:
    import yaml  # a core dependency, imported where it is needed

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{source} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source} must hold a mapping (base:, steps:), "
                              f"not {type(data).__name__}")
    return BuildSpec.parse(_env_as_text(data))


def _env_as_text(data: dict[str, Any]) -> dict[str, Any]:
    """YAML reads ``N: 1`` as a number: in a spec file, env values written as plain
    numbers or booleans mean their text (elsewhere, values must be strings)."""
    steps = data.get("steps")
    if not isinstance(steps, list):
        return data
    scalar = (int, float, bool)
    fixed = [
        {"env": {k: str(x) if isinstance(x, scalar) else x for k, x in step["env"].items()}}
        if isinstance(step, dict) and len(step) == 1 and isinstance(step.get("env"), dict)
        else step
        for step in steps
    ]
    return {**data, "steps": fixed}


def relative_copy_source(src: str) -> PurePosixPath:
    """A ``copy`` source as a path inside a build context; refuses absolute paths and
    ``..`` (a daemon only ever reads the context it was sent)."""
    p = PurePosixPath(src)
    if p.is_absolute() or ".." in p.parts or "\0" in src:
        raise InvalidArgument(
            f"copy source {src!r} must be relative to the build context, without '..'",
            details={"src": src},
        )
    return p


class ImageInfo(Model):
    """An image: what it is built from and what sandboxes made from it get.

    ``kind`` is ``debootstrap`` (the default image), ``rootfs`` (a directory tree added
    as is), ``oci`` (imported from a ``docker save`` or OCI archive) or ``built`` (a
    base image plus ``layers``, top first, from a build spec). ``env`` and ``workdir``
    are the defaults of sandboxes created from it (their own spec's values win);
    ``size_bytes`` counts the base too.
    """

    name: str
    kind: str
    digest: str
    created_at: float
    size_bytes: int
    base: str | None = None
    layers: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    python: str | None = None
    ref: str | None = Field(None, exclude_if=lambda v: v is None)  # pulled: its registry ref
    unique_bytes: int | None = None  # in listings: what deleting it alone would free


class ImageList(Model):
    images: list[ImageInfo]


class BuildRequest(_Strict):
    """``POST /v1/images/build``: a spec and the name to give the image (else the
    spec's ``name``). ``sources`` says where the sent context holds the source of a
    ``copy`` step (by step number, from 1) when not at the step's own ``src``."""

    spec: dict[str, Any]
    name: str | None = Field(None, max_length=64)
    sources: dict[int, _Path] = Field(default_factory=dict, max_length=MAX_STEPS)

    @field_validator("sources", mode="before")
    @classmethod
    def _step_numbers(cls, v: Any) -> Any:
        """JSON keys are text: a step number is written in digits (``"1"``), nothing
        else is read as one."""
        if isinstance(v, dict):
            for k in v:
                if isinstance(k, bool) or not isinstance(k, (int, str)) or (
                    isinstance(k, str) and not _STEP_NUMBER_RE.fullmatch(k)
                ):
                    raise ValueError(f"sources keys are step numbers such as '1', not {k!r}")
        return v


class BuildStats(Model):
    """What a build did: ``cached`` steps reused a layer, ``built`` steps ran."""

    steps: int
    cached: int
    built: int
    seconds: float


class BuildEvent(Model):
    """One line of a streamed build: a ``step`` starting (``cached`` if its layer was
    reused), a ``log`` line of its output, the ``image`` built (with ``stats``), or an
    ``error`` (an :class:`~corral.errors.ImageBuildError` names the step)."""

    type: Literal["step", "log", "image", "error"]
    step: int | None = None
    total: int | None = None
    instruction: str | None = None
    cached: bool | None = None
    line: str | None = None
    image: ImageInfo | None = None
    stats: BuildStats | None = None
    error: dict[str, Any] | None = None


class PullRequest(_Strict):
    """``POST /v1/images/pull``: a registry reference (``host[:port]/repo[:tag][@digest]``),
    the local name (default: derived from the reference) and whether plain HTTP is
    meant (accepted for loopback hosts and those the daemon lists)."""

    ref: str = Field(min_length=3, max_length=512)
    name: str | None = Field(None, max_length=64)
    insecure: bool = False


class PullEvent(Model):
    """One line of a streamed pull: a ``layer``'s progress (``bytes`` of ``size``,
    ``cached`` if it was stored before), a ``log`` line, the ``image`` pulled, or an
    ``error``."""

    type: Literal["layer", "log", "image", "error"]
    layer: int | None = None
    total: int | None = None
    digest: str | None = None
    size: int | None = None
    bytes: int | None = None
    cached: bool | None = None
    line: str | None = None
    image: ImageInfo | None = None
    error: dict[str, Any] | None = None


class PruneResult(Model):
    """What ``POST /v1/images/prune`` removed: layers no image, cache entry or mounted
    sandbox holds, and abandoned partial downloads."""

    layers: list[str]
    freed_bytes: int


class DockerfileRequest(_Strict):
    """``POST /v1/images/dockerfile`` (``dockerfile.json`` in the tar): the Dockerfile's
    text, the image's name, ``--build-arg`` values and the stage to stop at."""

    dockerfile: str = Field(min_length=1, max_length=1 << 20)
    name: str = Field(min_length=1, max_length=64)
    build_args: dict[str, str] = Field(default_factory=dict, max_length=256)
    target: str | None = Field(None, max_length=128)

    @field_validator("name")
    @classmethod
    def _image_name(cls, v: str) -> str:
        if not IMAGE_NAME_RE.fullmatch(v):
            raise ValueError(f"invalid image name {v!r}: use 1-64 of a-z, 0-9, '.', '_', '-'")
        return v
