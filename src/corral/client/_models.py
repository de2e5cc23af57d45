"""What SDK calls return, and the translation between them and the wire format.

Shared by the asyncio and the blocking client (see ``docs/api.md`` for the wire).
"""

from __future__ import annotations

import base64
import dataclasses
import subprocess
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Literal, TypedDict

from corral.api.models import EXEC_STATUS, ExecResponse, wire_bytes
from corral.client import _validate as check
from corral.errors import ExecTimeout, error_from_dict
from corral.network_schema import NetworkPolicy
from corral.schema import FileInfo, SandboxSpec


class SpecOptions(TypedDict, total=False):
    """The sandbox spec fields but ``image``, which ``Sandbox.create`` and ``Pool(...)``
    take as their first argument (``**spec: Unpack[SpecOptions]``)."""

    cpus: float
    memory_mb: int
    pids: int
    disk_mb: int
    inodes: int
    storage: str  # "memory" (default) | "disk": where the writable layer lives
    open_files: int
    timeout: float  # the sandbox's lifetime, seconds
    idle_timeout: float
    env: dict[str, str]
    secrets: dict[str, str]  # env whose values are never stored or shown
    workdir: str
    tags: Sequence[str]
    # "none" | "host" (a corral.schema.NetworkMode), an egress policy
    # {"allow": [...], "deny": [...]} (corral.network_schema; docs/network.md), or a
    # named network: a corral.Network / AsyncNetwork or its name
    network: str | dict[str, Any] | Any
    volumes: dict[str, str]  # {"/data": "NAME[:ro|cow|rw]"} (corral.volume_schema)
    snapshot: Any  # a Snapshot / AsyncSnapshot, its id or its name
    gpus: int | str | Sequence[str]  # a count, "all", or GPU indices/UUIDs
    gpu_shared: bool  # share the GPUs with other sandboxes that share (default: exclusive)
    checkpointable: bool  # its running processes can be checkpointed (docs/live.md)
    on_timeout: str  # "stop" (default) | "hibernate": what its timeout does (docs/live.md)
    run_entrypoint: bool  # start the image's ENTRYPOINT + CMD in the background on create


class SpecFields(SpecOptions, total=False):
    """The sandbox spec fields a caller may give, defined once: ``Sandbox.create``,
    ``Session.create``, ``Pool(...)`` and ``Snapshot.restore`` take them as keyword
    arguments (``**spec: Unpack[SpecFields]``), the CLI builds its flags' values into
    one. Left out means "the daemon's default" (see :class:`corral.schema.SandboxSpec`,
    which checks them)."""

    image: str


SPEC_FIELDS = ("image", *SpecOptions.__annotations__)


Command = str | Sequence[str]
"""An argv list (run as is) or a shell string (run by ``/bin/sh -c``)."""


@dataclasses.dataclass(frozen=True, repr=False)
class CommandResult:
    """How a command ended, with its output (like :class:`subprocess.CompletedProcess`).

    A timeout or an out-of-memory kill is a result, not an exception, so reward code
    can score it; ``check_returncode()`` (or ``exec(..., check=True)``) turns a
    failure into an exception.

    A stream longer than ``max_output`` is ``*_truncated``: it holds its head and its
    last ``output_tail`` bytes (where a verdict or a traceback is printed), and
    ``*_dropped`` bytes were left out between them (:meth:`head_and_tail` splits it).
    ``output_limited_to`` (0: as asked): the daemon's output memory budget could not
    hold more of the output at that moment and lowered the command's cap per stream to
    this, mid-stream (docs/api.md, "Output memory").

    >>> r = sb.exec(["python3", "-c", "print(6*7)"], timeout=10)   # doctest: +SKIP
    >>> r.returncode, r.stdout, r.ok                               # doctest: +SKIP
    (0, '42\\n', True)
    """

    args: Command
    returncode: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration: float = 0.0
    sandbox_id: str = ""
    timeout: float | None = None
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    output_tail: int = 0
    output_limited_to: int = 0

    @cached_property
    def stdout(self) -> str:
        """The standard output as text (invalid UTF-8 replaced by U+FFFD)."""
        return self.stdout_bytes.decode(errors="replace")

    @cached_property
    def stderr(self) -> str:
        """The standard error as text (invalid UTF-8 replaced by U+FFFD)."""
        return self.stderr_bytes.decode(errors="replace")

    @property
    def truncated(self) -> bool:
        """True if either stream went over ``max_output`` and lost bytes (its middle;
        with ``output_tail=0``, its end)."""
        return self.stdout_truncated or self.stderr_truncated

    def head_and_tail(self, stream: Literal["stdout", "stderr"] = "stdout") -> tuple[bytes, bytes]:
        """A stream's output as (head, tail): the bytes before and after those dropped
        (``*_dropped``); a stream that was not truncated is all head.

        >>> head, tail = r.head_and_tail("stderr")       # doctest: +SKIP
        >>> tail.decode().splitlines()[-1]               # doctest: +SKIP
        'ZeroDivisionError: division by zero'
        """
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r}")
        data: bytes = getattr(self, f"{stream}_bytes")
        if not getattr(self, f"{stream}_truncated"):
            return data, b""
        cut = max(0, len(data) - self.output_tail)
        return data[:cut], data[cut:]

    @property
    def ok(self) -> bool:
        """Exit status 0, in time, and not killed for memory."""
        return self.returncode == 0 and not self.timed_out and not self.oom_killed

    def __repr__(self) -> str:
        flags = "".join(
            f", {name}=True"
            for name in ("timed_out", "oom_killed", "truncated")
            if getattr(self, name)
        )
        return (
            f"CommandResult(returncode={self.returncode}, stdout={_clip(self.stdout)}, "
            f"stderr={_clip(self.stderr)}{flags}, duration={self.duration:.3f})"
        )

    def check_returncode(self) -> None:
        """Raise :class:`~corral.errors.ExecTimeout` if the command timed out, or
        :class:`subprocess.CalledProcessError` (with ``stdout``/``stderr``) if its exit
        status is not 0; the exception's ``result`` attribute is this result."""
        exc: Exception
        if self.timed_out:
            exc = ExecTimeout(
                f"sandbox {self.sandbox_id}: the command {describe_command(self.args)} timed out after "
                f"{self.timeout}s and was killed: raise timeout= or make it faster",
                details={"sandbox_id": self.sandbox_id, "timeout": self.timeout},
            )
        elif self.returncode != 0:
            exc = subprocess.CalledProcessError(
                self.returncode, self.args, output=self.stdout, stderr=self.stderr
            )
        else:
            return
        exc.result = self  # type: ignore[union-attr]  # our own attribute, documented above
        raise exc


@dataclasses.dataclass(frozen=True)
class OutputChunk:
    """A piece of a streamed command's output, as it was produced.

    ``data`` is exact; ``text`` decodes this chunk alone, so a multi-byte character
    split between two chunks shows as U+FFFD: join ``data`` when that matters.
    """

    stream: Literal["stdout", "stderr"]
    data: bytes
    dropped: int = 0
    """Not 0 on the one chunk (with no data) that marks the gap after a stream's head:
    that many bytes were left out there; its tail follows."""

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def describe_command(cmd: Command) -> str:
    """A short, quoted rendering of a command for messages."""
    return _clip(cmd if isinstance(cmd, str) else " ".join(cmd))


def spec_body(fields: dict[str, Any]) -> dict[str, Any]:
    """Validate the spec fields that were given (``None`` means "daemon default").

    Raises :class:`~corral.errors.InvalidArgument` before any request is sent.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    if "tags" in given:
        given["tags"] = check.strings("tags", given["tags"])
    if "env" in given:
        given["env"] = check.str_map("env", given["env"])
    for name in ("timeout", "idle_timeout"):
        if name in given:
            given[name] = check.timeout(name, given[name], optional=False)
    if "snapshot" in given:  # an (Async)Snapshot, its id or its name
        given["snapshot"] = check.text("snapshot", getattr(given["snapshot"], "id", given["snapshot"]))
    if "secrets" in given:
        given["secrets"] = check.str_map("secrets", given["secrets"])
    if "network" in given and not isinstance(given["network"], (str, dict, NetworkPolicy)):
        given["network"] = check.text("network", getattr(given["network"], "name", None))
    spec = SandboxSpec.parse(given)
    body = spec.model_dump(mode="json", exclude_unset=True)
    if "secrets" in body:  # the wire carries them in clear (the daemon masks them)
        body["secrets"] = spec.secret_env()
    return body


def exec_body(
    cmd: Command,
    *,
    timeout: float | None,
    env: dict[str, str] | None,
    cwd: str | None,
    stdin: bytes | str | None,
    max_output: int | None,
    output_tail: int | None = None,
    user: str | None = None,
) -> dict[str, Any]:
    """The ``ExecRequest`` of ``docs/api.md``; every argument checked first."""
    body: dict[str, Any] = {"cmd": check.command(cmd), "timeout": check.timeout("timeout", timeout)}
    if env:
        body["env"] = check.str_map("env", env)
    if cwd is not None:
        body["cwd"] = check.text("cwd", cwd)
    if stdin is not None:
        if isinstance(stdin, str):
            body["stdin"] = stdin
        else:
            raw = check.content("stdin", stdin)
            try:
                body["stdin"] = raw.decode()
            except UnicodeDecodeError:
                body["stdin_b64"] = base64.b64encode(raw).decode()
    if max_output is not None:
        body["max_output"] = check.integer("max_output", max_output, minimum=0)
    if output_tail is not None:
        body["output_tail"] = check.integer("output_tail", output_tail, minimum=0)
    if user is not None:
        body["user"] = check.text("user", user)
    return body


def parse_exec(
    data: dict[str, Any], *, args: Command, sandbox_id: str, timeout: float | None
) -> CommandResult:
    """Build a :class:`CommandResult` from an :class:`~corral.api.models.ExecResponse`
    (the model the daemon sends, checked here)."""
    reply = ExecResponse.model_validate(data)
    return CommandResult(
        args=args, sandbox_id=sandbox_id, timeout=timeout,
        stdout_bytes=wire_bytes(data, "stdout"), stderr_bytes=wire_bytes(data, "stderr"),
        **{name: getattr(reply, name) for name in EXEC_STATUS},
    )


def parse_stream_item(item: dict[str, Any]) -> OutputChunk | dict[str, Any] | None:
    """One line of an exec stream: an output chunk, the exit's ``ExecResponse``, or
    ``None`` for an item this SDK does not know; an ``error`` item raises."""
    kind = item.get("type")
    if kind in ("stdout", "stderr"):
        return OutputChunk(kind, wire_bytes(item, "data"), int(item.get("dropped") or 0))
    if kind == "exit":
        return dict(item["result"])
    if kind == "error":
        raise error_from_dict(item.get("error") or {})
    return None


_FILE_FIELDS = frozenset(f.name for f in dataclasses.fields(FileInfo))


def parse_file_info(data: dict[str, Any]) -> FileInfo:
    return FileInfo(**{k: v for k, v in data.items() if k in _FILE_FIELDS})
