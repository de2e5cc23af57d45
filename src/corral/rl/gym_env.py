"""A gymnasium environment whose real environment runs inside a corral sandbox.

:class:`SandboxEnv` is an ordinary :class:`gymnasium.Env` on this side. Its
environment — a registered id like ``"CartPole-v1"``, or your own class from a local
``.py`` file — is built and stepped by a small server (``corral.guest.env_server``)
running in a sandbox, reached over one persistent process (``sb.spawn``): each
``reset``/``step`` is one line written to the server's stdin and one line read back.
Values cross exactly (``corral.rl.spaces``): an observation arrives with its dtype,
shape and bytes, so ``check_env`` passes and a seeded trajectory is the same inside
and outside the sandbox.

Untrusted or heavy environment code thus runs isolated, with the sandbox's limits,
while the training loop stays in this process::

    import corral.rl

    env = corral.rl.SandboxEnv("CartPole-v1")               # image "rl" by default
    obs, info = env.reset(seed=42)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    env.close()                                              # deletes the sandbox

    env = corral.rl.SandboxEnv("envs/grid.py:GridWorld", size=5)  # your own class

An exception raised by the environment surfaces as :class:`EnvError` carrying the
remote traceback; the environment keeps serving (reset it and go on). When it was a
built-in exception, the error is also one of that type, so code written for gymnasium's
own envs still catches it: an invalid action in CartPole raises an ``AssertionError``
("5 (<class 'int'>) invalid") there, and here an :class:`EnvError` that is an
``AssertionError`` with that message.

Registered as ``corral/SandboxEnv-v0`` (see :mod:`corral.rl._gym_registration`)::

    env = gymnasium.make("corral/SandboxEnv-v0", env_id="CartPole-v1")
"""

from __future__ import annotations

import copy as copy_module
import os
import re
import secrets
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, SupportsFloat

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec
from gymnasium.utils import seeding

import corral
from corral.errors import CorralError, InvalidArgument
from corral.guest import program
from corral.rl import spaces as wire
from corral.rl._port_channel import HandedChannel, PortChannel, open_channel

DEFAULT_IMAGE = "rl"
"""The image with gymnasium and numpy installed (see the images' documentation)."""
SERVER_DIR = "/tmp/.corral-rl"
"""Where the server, its codec and uploaded modules go inside the sandbox."""
MODULES_DIR = f"{SERVER_DIR}/modules"
_HERE = Path(__file__).resolve().parent


class EnvError(CorralError):
    """The environment inside the sandbox raised, or its server died.

    ``remote_type`` is the exception's qualified name there (``"builtins.ValueError"``),
    ``remote_traceback`` its traceback as text (also part of the message), and
    ``details`` names the sandbox.
    """

    code, status = "env_error", 500

    def __init__(
        self,
        message: str,
        *,
        remote_type: str | None = None,
        remote_traceback: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        if remote_traceback:
            message = f"{message}\n\nTraceback in the sandbox:\n{remote_traceback.rstrip()}"
        super().__init__(message, details=details)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


# Built-in exceptions an environment may raise, re-raised here as EnvErrors of that
# type too (``except AssertionError`` works as with a local env). Only those whose
# instances have no extra fields (OSError's would clash) and a plain str() (KeyError's
# is the repr of its key).
_BUILTIN_ERRORS = (AssertionError, ValueError, TypeError, IndexError, RuntimeError,
                   NotImplementedError, AttributeError, ZeroDivisionError)
_TYPED_ERRORS: dict[str, type[EnvError]] = {}
for _base in _BUILTIN_ERRORS:
    _cls = type(f"Env{_base.__name__}", (EnvError, _base), {
        "__module__": __name__,
        # its own code (env_value_error...): a code names one class (tests/test_error_codes.py)
        "code": "env_" + re.sub(r"(?<!^)(?=[A-Z])", "_", _base.__name__).lower(),
        "__doc__": f"An :class:`EnvError` from a ``{_base.__name__}`` in the environment."})
    globals()[_cls.__name__] = _cls
    _TYPED_ERRORS[_base.__name__] = _cls
del _base, _cls


def env_error_type(remote_type: str | None) -> type[EnvError]:
    """The :class:`EnvError` class for an exception of ``remote_type`` in the sandbox."""
    return _TYPED_ERRORS.get(remote_type or "", EnvError)


# ------------------------------------------------------------------ the launch


def server_files() -> dict[str, bytes]:
    """The files the environment server needs in the sandbox: itself and its codec."""
    return {
        f"{SERVER_DIR}/env_server.py": program("env_server").encode(),
        f"{SERVER_DIR}/_corral_spaces.py": (_HERE / "spaces.py").read_bytes(),
    }


def resolve_env_id(env_id: str) -> tuple[str, dict[str, bytes]]:
    """``(id the server makes, files to upload)``.

    ``"path/to/file.py:Name"`` or ``"path/to/package:Name"`` (an existing local file or
    directory) is uploaded into the sandbox and becomes ``"file:Name"``; anything else
    (``"CartPole-v1"``, ``"installed.module:Name"``) is used as is.
    """
    if not isinstance(env_id, str) or not env_id.strip():
        raise InvalidArgument(
            f"env_id must be a gymnasium id ('CartPole-v1') or 'module:Class', got {env_id!r}"
        )
    module, sep, attribute = env_id.rpartition(":")
    local = Path(module) if sep else None
    if local is None or not (module.endswith(".py") or os.sep in module or "/" in module):
        return env_id, {}
    if local.is_file() and local.suffix == ".py":
        return f"{local.stem}:{attribute}", {f"{MODULES_DIR}/{local.name}": local.read_bytes()}
    if local.is_dir():
        files = {
            f"{MODULES_DIR}/{local.name}/{path.relative_to(local).as_posix()}": path.read_bytes()
            for path in sorted(local.rglob("*.py"))
        }
        return f"{local.name}:{attribute}", files
    raise InvalidArgument(
        f"env_id {env_id!r}: {module} is neither a local .py file nor a package directory "
        "(relative paths start at the current directory)"
    )


class _Remote:
    """One environment server in one sandbox: a request line in, a reply line out.

    ``streamed`` (a single env): each request is a ``write`` and the reply arrives on
    the process's output stream, kept open. That is the quickest round trip: the write
    is acknowledged while the environment computes (measured ~20% below an
    ``exchange`` per step, benchmarks/bench_gym.py). Otherwise (the remotes of a vector
    env) requests and replies are built and read apart (:meth:`request`,
    :meth:`reply`) so that one ``exchange_all`` serves all of them at once.
    """

    def __init__(self, sandbox: corral.Sandbox, *, own_sandbox: bool, streamed: bool) -> None:
        self.sandbox = sandbox
        self.own_sandbox = own_sandbox
        self.streamed = streamed
        self.process: corral.Process | None = None
        self.channel: PortChannel | HandedChannel | None = None  # the server's port socket, once it listens
        self.hello: dict[str, Any] = {}
        self.own_client: corral.Client | None = None

    @classmethod
    def start(
        cls,
        env_id: str,
        kwargs: Mapping[str, Any],
        *,
        image: str = DEFAULT_IMAGE,
        sandbox: corral.Sandbox | None = None,
        snapshot: corral.Snapshot | str | None = None,
        pool: corral.Pool | None = None,
        client: corral.Client | str | None = None,
        sandbox_options: Mapping[str, Any] | None = None,
        python: str = "python3",
        streamed: bool = True,
        port_channel: bool = True,
    ) -> _Remote:
        """A sandbox (given, from ``pool``, from ``snapshot``, or new on ``image``)
        running the server, with ``env_id`` made; nothing is left behind on failure."""
        target, files = resolve_env_id(env_id)
        if sum(x is not None for x in (sandbox, snapshot, pool)) > 1:
            raise InvalidArgument("pass at most one of sandbox=, snapshot= and pool=")
        options = dict(sandbox_options or {})
        # A daemon's URL (plain data, so a gymnasium spec holding it can be copied): a
        # client of this remote's own, closed with it.
        own_client = corral.Client(client) if isinstance(client, str) else None
        if client is not None:
            options["client"] = own_client or client
        try:
            if sandbox is not None:
                sb, own = sandbox, False
            elif pool is not None:
                sb, own = pool.acquire(), True
            elif snapshot is not None:
                sb, own = corral.Sandbox.create(snapshot=snapshot, **options), True
            else:
                sb, own = corral.Sandbox.create(image=image, **options), True
        except BaseException:
            if own_client is not None:
                own_client.close()
            raise
        remote = cls(sb, own_sandbox=own, streamed=streamed)
        remote.own_client = own_client
        try:
            for path, data in {**server_files(), **files}.items():
                remote.sandbox.files.write(path, data)
            remote.process = remote.sandbox.spawn(
                [python, f"{SERVER_DIR}/env_server.py"], text=False
            )
            remote.hello = remote.call(
                "make", id=target, kwargs=dict(kwargs), path=[MODULES_DIR] if files else []
            )
            if port_channel:
                remote.move_to_port()
        except BaseException:
            remote.close()
            raise
        return remote

    def request(self, op: str, **fields: Any) -> tuple[corral.Process, bytes]:
        """The server's process and the line asking it for ``op``."""
        if self.process is None:
            raise EnvError(f"the environment in sandbox {self.sandbox.id} is closed")
        return self.process, wire.dumps({"op": op, **fields})

    def reply(self, line: bytes) -> dict[str, Any]:
        """The fields of a reply line; :class:`EnvError` for an error or a dead server."""
        if not line:
            raise self._server_died()
        reply = wire.loads(line)
        if not reply.pop("ok", False):
            error = reply.get("error") or {}
            remote_type = str(error.get("type", "")).removeprefix("builtins.")
            raise env_error_type(remote_type)(
                f"{remote_type}: {error.get('message')} (the environment in sandbox "
                f"{self.sandbox.id})",
                remote_type=remote_type,
                remote_traceback=error.get("traceback"),
                details={"sandbox_id": self.sandbox.id},
            )
        return reply

    def move_to_port(self) -> None:
        """Go on over a port socket to the server (``_port_channel``) where the daemon
        offers one; else stay on the process's stdin and stdout."""
        token = secrets.token_hex(16)
        try:
            port = self.call("listen", token=token)["port"]
        except EnvError:
            return  # a server that cannot listen: stdin and stdout it is
        self.channel = open_channel(self.sandbox, port, token.encode() + b"\n")
        if self.channel is None:  # a request on stdin keeps the server there
            self.call("ping")

    def back_to_stdin(self) -> None:
        """Close the port socket: the server goes on on stdin and stdout (once this
        returns it holds no connection: a ``ping`` there is answered after it let go)."""
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
            self.call("ping")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        process, line = self.request(op, **fields)
        if self.channel is not None:
            self.channel.write(line)
            return self.reply(self.channel.readline())
        # an environment's step takes as long as it takes (its sandbox's lifetime bounds it)
        if self.streamed:
            process.write(line)
            return self.reply(process.readline(timeout=None))
        return self.reply(process.exchange(line, timeout=None))

    def _server_died(self) -> EnvError:
        assert self.process is not None
        result = self.process.wait(timeout=None)
        how = "was killed" if result.oom_killed or result.returncode < 0 else "exited"
        oom = " (out of memory: raise memory_mb in sandbox_options)" if result.oom_killed else ""
        tail = result.stderr.strip()[-4000:]
        return EnvError(
            f"the environment server in sandbox {self.sandbox.id} {how} with status "
            f"{result.returncode}{oom}" + (f"; its stderr:\n{tail}" if tail else ""),
            details={"sandbox_id": self.sandbox.id, "returncode": result.returncode},
        )

    def fork(self, seeds: Sequence[int | None],
             clients: Sequence[corral.Client] | None = None) -> list[_Remote]:
        """Live copies of this server and its sandbox as they are now, one per seed
        (``None``: not reseeded; else the server reseeds its generators), each a remote
        of its own whose :meth:`close` deletes its sandbox; all or nothing.
        ``clients``: the one each copy talks through (a remote with a client of its own
        gives each copy a new one)."""
        from corral.rl.branching import fork_sandbox

        if self.process is None:
            raise EnvError(f"the environment in sandbox {self.sandbox.id} is closed")
        pid, on_port = self.process.id, self.channel is not None
        if on_port:  # CRIU does not checkpoint a connected TCP socket: back to stdin
            self.back_to_stdin()
        try:
            made = fork_sandbox(self.sandbox, len(seeds), [pid], text=False)
        finally:
            if on_port:
                self.move_to_port()
        copies: list[_Remote] = []
        try:
            for j, ((sb, procs), seed) in enumerate(zip(made, seeds, strict=True)):
                remote = _Remote(sb, own_sandbox=True, streamed=self.streamed)
                remote.process, remote.hello = procs[pid], self.hello
                copies.append(remote)
                client = clients[j] if clients is not None else None
                if self.own_client is not None:  # the parent's closes with it
                    client = remote.own_client = corral.Client(**self.own_client.connect_args)
                if client is not None:
                    remote.sandbox = corral.Sandbox.connect(sb.id, client=client)
                    remote.process = remote.sandbox.process(pid, text=False)
                if on_port:
                    remote.move_to_port()
                if seed is not None:
                    remote.call("reseed", seed=seed)
        except BaseException:
            for r in copies:
                r.close()
            for sb, _ in made[len(copies):]:
                _Remote(sb, own_sandbox=True, streamed=False).close()
            raise
        return copies

    def close(self) -> None:
        """End the server and, if this remote made or acquired the sandbox, delete it."""
        process, self.process = self.process, None
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
        try:
            if process is not None and process.returncode is None:
                process.close()
        except CorralError:
            pass  # the sandbox is already gone
        finally:
            try:
                if self.own_sandbox:
                    self.own_sandbox = False
                    self.sandbox.delete()
            finally:
                if self.own_client is not None:
                    self.own_client.close()
                    self.own_client = None


def _close_quietly(remote: _Remote) -> None:
    try:
        remote.close()
    except Exception:  # at interpreter exit the daemon may be gone already
        pass


# ------------------------------------------------------------------- the env


class SandboxEnv(gym.Env):
    """A :class:`gymnasium.Env` whose environment runs in a corral sandbox.

    ``env_id`` is a gymnasium id (``"CartPole-v1"``; ``kwargs`` go to
    ``gymnasium.make``), ``"module:Class"`` importable in the sandbox, or
    ``"path/to/file.py:Class"`` / ``"path/to/package:Class"`` on this machine, uploaded
    into the sandbox (``kwargs`` go to the class).

    ``"module:Class"`` imports from the sandbox's Python path and its working directory
    (``/workspace``): an environment set up in a snapshot needs no upload.

    Where it runs: a new sandbox on ``image`` (``"rl"``: gymnasium 1.4 and numpy 2.4),
    created with ``sandbox_options`` (keyword arguments of :meth:`corral.Sandbox.create`:
    ``memory_mb``, ``timeout``, ...); or one restored from ``snapshot``; or one acquired
    from ``pool``; those are deleted by :meth:`close`. A ``sandbox`` you pass is yours:
    :meth:`close` leaves it running. A sandbox lives for its ``timeout`` (the daemon's
    default is one hour): for a longer training run pass
    ``sandbox_options={"timeout": 86400}``.

    The sandbox's ``python3`` runs the environment server, started once. With
    ``port_channel`` (the default) each ``reset``/``step`` then goes over a WebSocket to
    a loopback port of the server's, relayed by the daemon (:mod:`corral.server.port_socket`:
    about 0.3 ms on one host); without it, or where the daemon offers none (a cluster,
    no ``websockets`` package), one request to the daemon each (about a millisecond).
    It is registered as ``corral/SandboxEnv-v0``, so it is made like any environment
    (``gymnasium.make_vec`` makes a :class:`~corral.rl.SandboxVectorEnv`)::

        env = gymnasium.make("corral/SandboxEnv-v0", env_id="CartPole-v1")
        gymnasium.register("my/CartPole-v1", entry_point="corral.rl:SandboxEnv",
                           kwargs={"env_id": "CartPole-v1"})    # an id of your own

    Spaces, ``metadata`` and ``render_mode`` are the remote environment's. ``spec`` is
    set by ``gymnasium.make("corral/SandboxEnv-v0", ...)``; constructed directly, it is
    ``None``, because gymnasium deep-copies a spec's arguments (a client, pool or
    sandbox cannot be copied) and ``check_env`` would make one more sandbox per render
    mode from it. ``client`` may be a daemon's URL (a client of the env's own, closed
    with it): the form to give ``gymnasium.make``, whose spec then stays copyable. The
    remote environment's spec is :attr:`remote_spec`. ``np_random`` is
    seeded here as the remote environment's is by ``reset(seed=...)``; the draws the
    environment makes while stepping happen in the sandbox.
    """

    def __init__(
        self,
        env_id: str,
        *,
        image: str = DEFAULT_IMAGE,
        sandbox: corral.Sandbox | None = None,
        snapshot: corral.Snapshot | str | None = None,
        pool: corral.Pool | None = None,
        client: corral.Client | str | None = None,
        sandbox_options: Mapping[str, Any] | None = None,
        python: str = "python3",
        port_channel: bool = True,
        **kwargs: Any,
    ) -> None:
        self.env_id = env_id
        self._attach(_Remote.start(
            env_id, kwargs, image=image, sandbox=sandbox, snapshot=snapshot, pool=pool,
            client=client, sandbox_options=sandbox_options, python=python,
            port_channel=port_channel,
        ))

    def _attach(self, remote: _Remote) -> None:
        self._remote = remote
        self._finalizer = weakref.finalize(self, _close_quietly, self._remote)
        hello = self._remote.hello
        self.observation_space = wire.space_from_dict(hello["observation_space"])
        self.action_space = wire.space_from_dict(hello["action_space"])
        self.metadata = hello["metadata"]
        self.render_mode = hello["render_mode"]
        self.remote_spec: EnvSpec | None = (
            EnvSpec.from_json(hello["spec"]) if hello.get("spec") else None
        )
        self.spec = None  # gymnasium.make sets it

    @property
    def sandbox(self) -> corral.Sandbox:
        """The sandbox the environment runs in."""
        return self._remote.sandbox

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        reply = self._call("reset", seed=seed, options=options)
        return reply["obs"], reply["info"]

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        reply = self._call("step", action=action)
        return (
            reply["obs"], reply["reward"], reply["terminated"], reply["truncated"], reply["info"]
        )

    def render(self) -> Any:
        """The remote environment's ``render()`` (an RGB array, text, or ``None``)."""
        return self._call("render")["frame"]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The remote environment's attribute ``name`` (through its wrappers); called
        with ``args``/``kwargs`` if it is a method. Arguments and result cross like
        observations do."""
        return self._call("call", name=name, args=list(args), kwargs=kwargs)["value"]

    def set_attr(self, name: str, value: Any) -> None:
        """Set an attribute of the remote environment (through its wrappers)."""
        self._call("set_attr", name=name, value=value)

    def fork(self, n: int, *, reseed: bool | int | Sequence[int] = True) -> list[SandboxEnv]:
        """``n`` running copies of this environment as it is now, mid-episode (a live
        fork of its sandbox: the environment's memory, its server and its open pipes;
        docs/rl.md, "Branching"), each a :class:`SandboxEnv` of its own whose
        :meth:`close` deletes its sandbox. Only an environment whose sandbox was created
        checkpointable (``sandbox_options={"checkpointable": True}``).

        ``reseed`` (:func:`~corral.rl.branching.branch_seeds`): ``True`` (default) gives
        each copy a fresh seed, ``False`` keeps the parent's randomness (every copy
        replays it), an int derives the seeds from it, a list of ``n`` ints gives them.
        A seed reseeds, inside the copy, Python's ``random``, NumPy's and PyTorch's global
        generators, the environment's ``np_random`` and its spaces; here, the copy's
        ``np_random``. All or nothing: on failure no copy is left."""
        from corral.rl.branching import branch_seeds

        seeds = branch_seeds(n, reseed)
        remotes = self._remote.fork(seeds)
        copies: list[SandboxEnv] = []
        try:
            for remote, seed in zip(remotes, seeds, strict=True):
                copy = object.__new__(type(self))
                copy.__dict__.update({k: v for k, v in self.__dict__.items()
                                      if k not in ("_remote", "_finalizer", "_np_random")})
                copy._attach(remote)
                copy.spec = self.spec
                copies.append(copy)
                if seed is not None:
                    copy._np_random, copy._np_random_seed = seeding.np_random(seed)
                elif self._np_random is not None:
                    copy._np_random = copy_module.deepcopy(self._np_random)
        except BaseException:
            for r in remotes:
                r.close()
            raise
        return copies

    def close(self) -> None:
        """Close the remote environment, end its server and delete the sandbox (unless
        it was passed in as ``sandbox=``). Idempotent."""
        remote = getattr(self, "_remote", None)
        if remote is None or remote.process is None and not remote.own_sandbox:
            return
        try:
            if remote.process is not None and remote.process.returncode is None:
                remote.call("close")
        except CorralError:
            pass  # a dead server or sandbox: nothing left to close politely
        finally:
            self._finalizer.detach()
            remote.close()

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        return self._remote.call(op, **fields)

    def __repr__(self) -> str:
        return f"<SandboxEnv {self.env_id} in {self._remote.sandbox.id}>"

    __str__ = __repr__
