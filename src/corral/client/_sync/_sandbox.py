# Generated from _async/_sandbox.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""One sandbox: create, connect, run commands, move files, pause, stop, delete; and a
snapshot of one, which new sandboxes start from (one module: each makes the other)."""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator, Sequence
from typing import Any

from typing_extensions import Self, Unpack  # typing's since 3.11 only

from corral.client import _validate
from corral.client._sync._cleanup import CleanupOnExit
from corral.client._sync._client import Client
from corral.client._sync._files import Files
from corral.client._sync._logs import LogEntry, follow_logs, read_logs
from corral.client._sync._process import Process
from corral.client._sync._run_once import run_once
from corral.client._sync._stream import ExecStream
from corral.client._backends import SyncBackend, Opening
from corral.client._config import (
    CREATE_TIMEOUT,
    CREATE_WAIT_MARGIN,
    auto_tags,
    exec_http_timeout,
)
from corral.client._futures import SandboxFutures
from corral.client._models import (
    Command,
    CommandResult,
    SpecFields,
    SpecOptions,
    exec_body,
    parse_exec,
    spec_body,
)
from corral.errors import InvalidArgument
from corral.schema import (
    DEFAULT_EXEC_TIMEOUT_S,
    MAX_TAGS,
    SandboxInfo,
    SandboxState,
    SnapshotInfo,
)


class Sandbox(CleanupOnExit, SandboxFutures):
    """An isolated sandbox on a corral daemon.

    Make one with :meth:`create` (or attach to one with :meth:`connect`); used as a
    context manager, it is deleted when the block ends, also after an exception::

        with corral.Sandbox.create(image="python", timeout=600) as sb:
            r = sb.exec(["python3", "-c", "print(6*7)"], timeout=10)
            assert r.stdout == "42\\n"
            sb.files.write("/app/solution.py", b"print(1)")

    ``info`` and ``state`` are as of the last call that returned them; :meth:`refresh`
    asks the daemon again.
    """

    def __init__(
        self, info: SandboxInfo, *, client: Client, usage: dict[str, float] | None = None
    ) -> None:
        self._info = info
        self._client = client
        self._usage = usage
        self._ids = {"sandbox_id": info.id}
        self._files = Files(client, info.id)

    # ------------------------------------------------------------- factories

    @classmethod
    def create(
        cls,
        image: str | None = None,
        *,
        node: str | None = None,
        client: Client | None = None,
        wait: float | None = None,
        **spec: Unpack[SpecOptions],
    ) -> Opening[Self]:
        """Start a sandbox and return once it can run commands.

        Every limit left out (``None``) takes the daemon's default (see
        :class:`corral.schema.SandboxSpec`); ``timeout`` is the sandbox's lifetime in
        seconds, after which the daemon stops it. Invalid values raise
        :class:`~corral.errors.InvalidArgument` before anything is sent.

        A full daemon queues the create, and a tenant at its quota (``corral token
        create --max-sandboxes ...``) waits for its own sandboxes to end: at most
        ``wait`` seconds (default: as long as the request may take, 590 s; the
        daemon's ``--queue-timeout`` caps it), then
        :class:`~corral.errors.CapacityExceeded` or
        :class:`~corral.errors.QuotaExceeded`. ``wait=0`` fails at once.

        ``snapshot`` (a :class:`Snapshot`, its id or name) starts the sandbox on
        the snapshot's files; the limits left out then come from the sandbox the
        snapshot was taken from. :class:`~corral.errors.SnapshotNotFound` if none.

        ``secrets`` are environment variables whose values the daemon never stores or
        shows (``"**********"`` in :attr:`info`, listings and logs); commands see them.

        On a Ray cluster (``CORRAL_URL=ray://...``) the sandbox goes to the node with the
        most room (a Ray task's own node while it has room); ``node`` (a node id from
        ``corral cluster status``) pins it. :attr:`info` ``.node`` says where it runs.

        With asyncio, both ``with Sandbox.create(...) as sb`` and
        ``with Sandbox.create(...) as sb`` work.
        """
        body = spec_body({"image": image, **spec})
        if node is not None:
            node = _validate.text("node", node)
        if wait is not None:
            wait = _validate.timeout("wait", wait, optional=False, zero=True)
        return SyncBackend.opening(cls._create(body, client, node, wait))

    @classmethod
    def _create(
        cls, body: dict[str, Any], client: Client | None, node: str | None = None,
        wait: float | None = None,
    ) -> Self:
        client = client or Client.default()
        tags = auto_tags()  # wandb-run:ID, slurm-job:ID of this process
        if tags:
            merged = list(dict.fromkeys([*body.get("tags", []), *tags]))[:MAX_TAGS]
            body = {**body, "tags": merged}
        timeout = max(client.timeout, CREATE_TIMEOUT)
        # the daemon may wait for room or for a tenant's quota: say how long this
        # caller waits, so that it answers before the caller gives up
        longest = max(0.0, timeout - CREATE_WAIT_MARGIN)
        wait = longest if wait is None else min(wait, longest)
        response = client.call(
            "create_sandbox", json=body, timeout=timeout, node=node,
            params={"wait": f"{wait:g}"},
        )
        return cls(SandboxInfo.model_validate(response.json()), client=client)

    run_once = staticmethod(run_once)

    @classmethod
    def connect(cls, sandbox_id: str, *, client: Client | None = None) -> Self:
        """Attach to an existing sandbox; :class:`~corral.errors.SandboxNotFound` if none."""
        sandbox_id = _validate.text("sandbox_id", sandbox_id)
        client = client or Client.default()
        data = (client.call("get_sandbox", {"sandbox_id": sandbox_id})).json()
        return cls(SandboxInfo.model_validate(data), client=client, usage=data.get("usage"))

    @classmethod
    def list(
        cls,
        *,
        tags: Sequence[str] = (),
        state: SandboxState | str | Sequence[SandboxState | str] | None = None,
        client: Client | None = None,
    ) -> builtins.list[Self]:
        """The sandboxes that carry every tag in ``tags`` and are in ``state`` (one or
        several), oldest first.

        >>> [sb.id for sb in corral.Sandbox.list(tags=["job=42"], state="running")]
        """
        tags = _validate.strings("tags", tags)
        states = [state] if isinstance(state, (str, SandboxState)) else list(state or ())
        valid = {s.value for s in SandboxState}
        states = [getattr(s, "value", s) for s in states]
        for s in states:
            if s not in valid:
                raise _validate.invalid("state", f"expected one of {sorted(valid)}, got {s!r}")
        client = client or Client.default()
        params = [("tag", t) for t in tags] + [("state", s) for s in states]
        response = client.call("list_sandboxes", params=params)
        return [
            cls(SandboxInfo.model_validate(d), client=client) for d in response.json()["sandboxes"]
        ]

    # ------------------------------------------------------------ properties

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        """Identity, state, spec and timestamps, as last seen."""
        return self._info

    @property
    def state(self) -> SandboxState:
        """The state as last seen (:meth:`refresh` updates it), except that a sandbox
        last seen running or paused whose lifetime (``timeout`` seconds from its start)
        has run out by this host's clock is ``STOPPED``: the daemon stops it then."""
        state = self._info.state
        started = self._info.started_at
        if (state in (SandboxState.RUNNING, SandboxState.PAUSED) and started is not None
                and time.time() > started + self._info.spec.timeout):
            return SandboxState.STOPPED
        return state

    @property
    def tags(self) -> builtins.list[str]:
        return self._info.tags

    @property
    def usage(self) -> dict[str, float] | None:
        """``{"cpu_seconds", "memory_mb"}`` as of the last :meth:`refresh`, if it ran."""
        return self._usage

    @property
    def files(self) -> Files:
        """The sandbox's files: ``read``, ``write``, ``list``, ``upload``, ..."""
        return self._files

    @property
    def client(self) -> Client:
        return self._client

    # ------------------------------------------------------------- lifecycle

    def refresh(self) -> SandboxInfo:
        """Ask the daemon for this sandbox's current info (and usage)."""
        data = (self._client.call("get_sandbox", self._ids)).json()
        self._info = SandboxInfo.model_validate(data)
        self._usage = data.get("usage")
        return self._info

    def _lifecycle(self, action: str, body: dict[str, Any] | None = None) -> SandboxInfo:
        response = self._client.call(action, self._ids, json=body)
        self._info = SandboxInfo.model_validate(response.json())
        return self._info

    def pause(self) -> SandboxInfo:
        """Freeze every process of the sandbox (it keeps its memory)."""
        return self._lifecycle("pause_sandbox")

    def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox, or restore a hibernated one (same id)."""
        return self._lifecycle("resume_sandbox")

    def hibernate(self) -> SandboxInfo:
        """Write the processes of a sandbox created ``checkpointable=True`` to disk and
        free its memory, keeping its id (state ``paused``); :meth:`resume`, or its next
        command or file operation, brings them back where they were (docs/live.md)."""
        return self._lifecycle("hibernate_sandbox")

    def kill_processes(self) -> int:
        """SIGKILL every process this sandbox's code started — commands, spawned
        processes and whatever they left running — and wait until they are gone; the
        sandbox keeps running with its files. Returns how many there were. Killed from
        outside (through its cgroup), so nothing inside can dodge or race it."""
        response = self._client.call("kill_processes", self._ids)
        return int(response.json()["killed"])

    def stop(self, *, grace: float | None = None) -> SandboxInfo:
        """Stop the sandbox's processes (SIGTERM, then SIGKILL after ``grace`` seconds);
        the sandbox stays listed until :meth:`delete`."""
        if grace is None:
            return self._lifecycle("stop_sandbox", {})
        return self._lifecycle("stop_sandbox", {"grace": _validate.timeout(
            "grace", grace, zero=True, maximum=_validate.MAX_STOP_GRACE_S
        )})

    def delete(self) -> None:
        """Stop the sandbox and remove it and its files; deleting twice is fine."""
        self._client.call("delete_sandbox", self._ids)

    def set_timeout(self, seconds: float) -> SandboxInfo:
        """End the sandbox ``seconds`` from now, sooner or later than it would have
        (within the daemon's ``--max-lifetime``); it then stops with reason timeout."""
        body = {"timeout": _validate.timeout("timeout", seconds, optional=False)}
        response = self._client.call("patch_sandbox", self._ids, json=body)
        self._info = SandboxInfo.model_validate(response.json())
        return self._info

    # --------------------------------------------------------------- network

    def expose(self, port: int) -> str:
        """Serve ``port`` (an HTTP or WebSocket server listening in the sandbox) through
        the daemon; the URL returned carries the port's own access token: whoever holds
        it reaches that port and nothing else, until the sandbox ends. Works with
        ``network="none"`` too. See docs/network.md."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"invalid port {port!r}: use 1-65535")
        response = self._client.call("expose_port", self._ids, json={"port": port})
        url: str = response.json()["url"]
        return url

    def network_events(self) -> builtins.list[dict[str, Any]]:
        """What a sandbox created with a network policy tried to reach, oldest first
        (the last 1000): dicts with time, kind (``tcp``, ``dns``), name, ip, port,
        verdict (``allowed``, ``refused``) and reason. See docs/network.md."""
        response = self._client.call("network_events", self._ids)
        events: builtins.list[dict[str, Any]] = response.json()["events"]
        return events

    def update_network(self, *, allow: Sequence[str] = (), deny: Sequence[str] = (),
                             max_mbps: int | None = None) -> SandboxInfo:
        """Enforce a new egress policy from now on (only on a sandbox created with
        one); open connections the new policy refuses are reset. ``max_mbps``: a
        bandwidth cap each way (None: none)."""
        body: dict[str, Any] = {"allow": list(allow), "deny": list(deny), "max_mbps": max_mbps}
        response = self._client.call("update_network", self._ids, json=body)
        self._info = SandboxInfo.model_validate(response.json())
        return self._info

    def logs(self, *, after: int = 0) -> builtins.list[LogEntry]:
        """Its commands and lifecycle events (dicts, oldest first; see
        ``corral.client._sync._logs``), also after it stopped, until it is deleted."""
        return read_logs(self._client, self._ids, after)

    def follow_logs(self, *, after: int = 0) -> Iterator[LogEntry]:
        """Iterate over entries as they are logged, until the sandbox ends."""
        return follow_logs(self._client, self._ids, after)

    # ------------------------------------------------------------- snapshots

    def snapshot(self, name: str | None = None) -> Snapshot:
        """Commit the sandbox's files as a snapshot (its processes are frozen meanwhile,
        then go on); start copies with :meth:`Snapshot.restore` or
        ``create(snapshot=...)``. ``name`` must be unique on the daemon."""
        body = {} if name is None else {"name": _validate.text("name", name)}
        response = self._client.call("snapshot_sandbox", self._ids, json=body)
        return Snapshot(SnapshotInfo.model_validate(response.json()), client=self._client)

    def checkpoint(self, name: str | None = None) -> Snapshot:
        """Save the sandbox's running processes and files as a live snapshot (``kind``
        ``"live"``); it keeps running. ``create(snapshot=...)`` or
        :meth:`Snapshot.restore` runs the processes on from where they were, in a
        new sandbox. Only a sandbox created with ``checkpointable=True``; where the host
        cannot (no CRIU, a process it refuses) :class:`~corral.errors.Unsupported` with
        ``details["cause"]`` (docs/live.md)."""
        body = {} if name is None else {"name": _validate.text("name", name)}
        response = self._client.call(
            "checkpoint_sandbox", self._ids, json=body,
            timeout=max(self._client.timeout, CREATE_TIMEOUT),
        )
        return Snapshot(SnapshotInfo.model_validate(response.json()), client=self._client)

    def fork(self, n: int, *, live: bool | None = None) -> builtins.list[Self]:
        """``n`` new sandboxes with a copy of this one's files and its spec (each waits
        for room like a create); all or nothing. Delete them when done. ``live``: its
        running processes too, each copy going on from where they were (default: when
        the sandbox is checkpointable; docs/live.md)."""
        body: dict[str, object] = {"n": _validate.integer("n", n, minimum=1)}
        if live is not None:
            body["live"] = bool(live)
        response = self._client.call(
            "fork_sandbox", self._ids, json=body,
            timeout=max(self._client.timeout, CREATE_TIMEOUT),
        )
        return [
            type(self)(SandboxInfo.model_validate(d), client=self._client)
            for d in response.json()["sandboxes"]
        ]

    # ------------------------------------------------------------------ exec

    def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int | None = None,
        output_tail: int | None = None,
        check: bool = False,
        user: str | None = None,
    ) -> CommandResult:
        """Run a command to completion and return its :class:`~corral.CommandResult`.

        ``cmd`` is an argv list or a shell string (run by ``/bin/sh -c``). A command
        still running after ``timeout`` seconds (``None``: no limit) is killed and
        returned with ``timed_out=True``. Each stream keeps ``max_output`` bytes at
        most (daemon default 1 MiB): a longer one keeps its head and its last
        ``output_tail`` bytes (default: half of ``max_output``, at most 8 MiB; ``0``:
        the head only), and ``stdout_dropped``/``stderr_dropped`` count the bytes left
        out between them. With ``check=True``, a timeout raises
        :class:`~corral.errors.ExecTimeout` and a non-zero exit status
        :class:`subprocess.CalledProcessError`, like :func:`subprocess.run`.
        ``r.stdout`` / ``r.stderr`` are text (UTF-8, invalid bytes replaced);
        ``r.stdout_bytes`` / ``r.stderr_bytes`` are the bytes as written (binary output).
        ``user="root"`` runs it as root of the sandbox's user namespace (default: the
        image's ``USER``, else the sandbox user, uid 1000; docs/users.md).

        >>> r = sb.exec("echo $GREETING", env={"GREETING": "hi"})
        >>> r.stdout
        'hi\\n'
        """
        body = exec_body(
            cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin, max_output=max_output,
            output_tail=output_tail, user=user,
        )
        _validate.flag("check", check)
        response = self._client.call(
            "exec_command", self._ids, json=body, timeout=exec_http_timeout(timeout)
        )
        result = parse_exec(response.json(), args=cmd, sandbox_id=self.id, timeout=timeout)
        if check:
            result.check_returncode()
        return result

    def exec_stream(
        self,
        cmd: Command,
        *,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int | None = None,
        output_tail: int | None = None,
        check: bool = False,
        user: str | None = None,
    ) -> ExecStream:
        """Run a command and iterate over its output as it is written.

        Takes the arguments of :meth:`exec`. The items are
        :class:`~corral.OutputChunk` (``.stream`` is ``"stdout"`` or ``"stderr"``,
        ``.data`` bytes, ``.text``); after the last one, the stream's ``.result`` is
        the :class:`~corral.CommandResult` (with the whole output). A stream over its
        cap yields one chunk with ``dropped`` set (and no data) between its head and
        its tail::

            with sb.exec_stream("pip install -q requests", timeout=120) as run:
                for chunk in run:
                    print(chunk.text, end="")
            print(run.result.returncode)
        """
        body = exec_body(
            cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin, max_output=max_output,
            output_tail=output_tail, user=user,
        )
        _validate.flag("check", check)
        return ExecStream(
            self._client, body, args=cmd, sandbox_id=self.id, check=check,
        )

    def spawn(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        text: bool = True,
        max_buffer: int | None = None,
        pty: bool = False,
        rows: int | None = None,
        cols: int | None = None,
        user: str | None = None,
    ) -> Process:
        """Start an interactive process: its stdin stays open and its output is read
        while it runs (see :class:`~corral.Process`). ``timeout`` (seconds,
        ``None``: none) kills it; it ends with the sandbox in any case. ``text=False``
        makes :meth:`~corral.Process.readline` return bytes. ``max_buffer``: bytes
        of unread output the daemon keeps (default 16 MiB).

        ``pty=True`` runs it on a pseudo-terminal of ``rows`` x ``cols`` (default 24 x
        80) inside the sandbox: an interactive shell, ``tty`` and ``stty`` work, its
        output is one stream (stdout), Ctrl-C is ``write("\x03")``,
        :meth:`~corral.Process.resize` changes the size and
        :meth:`~corral.Process.close_stdin` types Ctrl-D.

        >>> with sb.spawn(["python3", "-u", "repl.py"]) as proc:
        ...     proc.write("1 + 1\n")
        ...     answer = proc.readline()
        """
        body = exec_body(cmd, timeout=timeout, env=env, cwd=cwd, stdin=None, max_output=None,
                         user=user)
        _validate.flag("text", text)
        if max_buffer is not None:
            body["max_buffer"] = _validate.integer("max_buffer", max_buffer, minimum=1)
        if _validate.flag("pty", pty):
            body["pty"] = True
        for name, size in (("rows", rows), ("cols", cols)):
            if size is not None:
                if not pty:
                    raise _validate.invalid(name, f"{name} sizes a terminal: pass pty=True too")
                body[name] = _validate.integer(name, size, minimum=1)
        response = self._client.call("spawn_process", self._ids, json=body)
        return Process(response.json(), client=self._client, args=cmd, text=text)

    def process(self, process_id: str, *, text: bool = True) -> Process:
        """A process of this sandbox by its id (``proc-...``): one it spawned, or, in a
        live fork's copy, one it was checkpointed with (same id, its own copy of the
        process: docs/live.md). :class:`~corral.errors.NotFound` if it has none."""
        ids = {**self._ids, "process_id": _validate.text("process_id", process_id)}
        info = (self._client.call("get_process", ids)).json()
        return Process(info, client=self._client, args=info["cmd"], text=text)

    def _cleanup(self) -> None:
        self.delete()

    def __reduce__(self) -> tuple[Any, ...]:
        """A sandbox pickles as its info and how to reach its daemon (not its
        connections), so one made in a Ray driver can be used in a Ray task."""
        return (_unpickle, (type(self), self._info.model_dump(mode="json"),
                            self._client.connect_args))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.state.value} image={self._info.image!r}>"


def _unpickle(cls: type[Sandbox], info: dict[str, Any], connect: dict[str, Any]) -> Any:
    return cls(SandboxInfo.model_validate(info), client=Client.reopen(**connect))


class Snapshot:
    """A snapshot on the daemon; take one with :meth:`Sandbox.snapshot`.

    Every sandbox restored from it starts with the files the sandbox had when the
    snapshot was taken, and the spec fields not given (all but ``tags``); copies never
    see each other's writes::

        snap = base.snapshot(name="with-deps")
        sb = snap.restore(tags=["episode=1"])      # or Sandbox.create(snapshot=snap)
        snap.delete()                              # sb keeps running
    """

    def __init__(self, info: SnapshotInfo, *, client: Client) -> None:
        self._info = info
        self._client = client
        self._ids = {"id_or_name": info.id}

    @classmethod
    def get(cls, id_or_name: str, *, client: Client | None = None) -> Self:
        """A snapshot by id or name; :class:`~corral.errors.SnapshotNotFound` if none."""
        client = client or Client.default()
        response = client.call("get_snapshot", {"id_or_name": id_or_name})
        return cls(SnapshotInfo.model_validate(response.json()), client=client)

    @classmethod
    def list(cls, *, client: Client | None = None) -> builtins.list[Self]:
        """Every snapshot on the daemon."""
        client = client or Client.default()
        response = client.call("list_snapshots")
        return [
            cls(SnapshotInfo.model_validate(d), client=client)
            for d in response.json()["snapshots"]
        ]

    @property
    def info(self) -> SnapshotInfo:
        return self._info

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def name(self) -> str | None:
        return self._info.name

    @property
    def image(self) -> str:
        return self._info.image

    @property
    def layers(self) -> builtins.list[str]:
        return self._info.layers

    @property
    def size_bytes(self) -> int:
        return self._info.size_bytes

    @property
    def created_at(self) -> float:
        return self._info.created_at

    @property
    def client(self) -> Client:
        return self._client

    def restore(
        self, *, client: Client | None = None, **overrides: Unpack[SpecFields]
    ) -> Sandbox:
        """A new sandbox on this snapshot's files; ``overrides`` are keyword arguments
        of :meth:`Sandbox.create` (``memory_mb``, ``tags``, ...)."""
        overrides["snapshot"] = self.id
        return Sandbox.create(client=client or self._client, **overrides)

    def delete(self) -> None:
        """Delete the snapshot (idempotent); sandboxes restored from it keep running."""
        self._client.call("delete_snapshot", self._ids)

    def __repr__(self) -> str:
        name = f" name={self.name!r}" if self.name else ""
        return f"<{type(self).__name__} {self.id}{name} image={self.image!r}>"
