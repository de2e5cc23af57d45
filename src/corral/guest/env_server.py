"""The server side of :class:`corral.rl.SandboxEnv`: runs inside a sandbox, hosts one
gymnasium environment, and answers requests on stdin with replies on stdout.

It is uploaded into the sandbox as ``env_server.py`` with the codec (``corral.rl.spaces``,
as ``_corral_spaces.py`` next to it) and run by the sandbox's ``python3``. Importing it
needs only the standard library; running it needs the image's gymnasium and numpy
(imported inside functions) and the codec, handed to :func:`serve` (:func:`main`
imports the uploaded one), nothing of corral. One line per message, both ways::

    -> {"op": "make", "id": "CartPole-v1", "kwargs": {...}, "path": [...]}
    <- {"ok": true, "observation_space": {...}, "action_space": {...}, ...}
    -> {"op": "step", "action": ...}
    <- {"ok": true, "obs": ..., "reward": 1.0, "terminated": false, ...}
    <- {"ok": false, "error": {"type": "ValueError", "message": ..., "traceback": ...}}

An exception in the environment becomes an error reply with its traceback, and the
server goes on serving (the caller may reset). The environment's own prints go to
stderr: stdout carries only replies.
"""

from __future__ import annotations

import hmac
import importlib
import os
import select
import socket
import sys
import time
import traceback
from types import ModuleType
from typing import Any, BinaryIO


def build_env(env_id: str, kwargs: dict[str, Any]) -> Any:
    """``module:Attribute`` calls that attribute (a class or factory) if the module
    has it; anything else, ``module:EnvId`` included, goes to ``gymnasium.make``."""
    import gymnasium as gym

    if ":" in env_id:
        module_name, _, attribute = env_id.partition(":")
        module = importlib.import_module(module_name)
        factory = getattr(module, attribute, None)
        if callable(factory):
            env = factory(**kwargs)
            if not isinstance(env, gym.Env):
                raise TypeError(
                    f"{env_id} returned a {type(env).__name__}, not a gymnasium.Env"
                )
            return env
    return gym.make(env_id, **kwargs)


def _spec_json(env: Any) -> str | None:
    try:
        return env.spec.to_json() if env.spec is not None else None
    except Exception:  # a spec with callables in it cannot be described
        return None


class EnvServer:
    """The requests one environment answers (``op`` → method ``op_<op>``)."""

    def __init__(self, wire: ModuleType) -> None:
        self.wire = wire  # the codec: corral.rl.spaces, uploaded as _corral_spaces
        self.env: Any = None
        self.listener: socket.socket | None = None  # made by op_listen, for serve()
        self.token = b""

    def _env(self) -> Any:
        if self.env is None:
            raise RuntimeError("no environment yet: the first request must be 'make'")
        return self.env

    def op_make(self, id: str, kwargs: dict[str, Any], path: list[str] = ()) -> dict[str, Any]:
        for entry in reversed(path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        import gymnasium as gym

        env = self.env = build_env(id, kwargs)
        return {
            "observation_space": self.wire.space_to_dict(env.observation_space),
            "action_space": self.wire.space_to_dict(env.action_space),
            "metadata": dict(env.metadata),
            "render_mode": env.render_mode,
            "spec": _spec_json(env),
            "python": sys.version.split()[0],
            "gymnasium": gym.__version__,
        }

    def op_reset(self, seed: int | None = None, options: dict | None = None) -> dict[str, Any]:
        obs, info = self._env().reset(seed=seed, options=options)
        return {"obs": obs, "info": info}

    def op_step(self, action: Any, autoreset: bool = False) -> dict[str, Any]:
        """One step; with ``autoreset``, an episode that ends is reset at once and the
        reply also carries ``final_obs``/``final_info`` (gymnasium's same-step mode)."""
        env = self._env()
        obs, reward, terminated, truncated, info = env.step(action)
        reply = {"obs": obs, "reward": reward, "terminated": terminated,
                 "truncated": truncated, "info": info}
        if autoreset and (terminated or truncated):
            reply["final_obs"], reply["final_info"] = obs, info
            reply["obs"], reply["info"] = env.reset()
        return reply

    def op_render(self) -> dict[str, Any]:
        return {"frame": self._env().render()}

    def op_call(self, name: str, args: list | None = None, kwargs: dict | None = None
                ) -> dict[str, Any]:
        value = self._env().get_wrapper_attr(name)
        if callable(value):
            value = value(*(args or ()), **(kwargs or {}))
        return {"value": value}

    def op_set_attr(self, name: str, value: Any) -> dict[str, Any]:
        self._env().set_wrapper_attr(name, value)
        return {}

    def op_reseed(self, seed: int) -> dict[str, Any]:
        """A live fork's copy goes its own way (corral.rl.SandboxEnv.fork): Python's
        ``random``, NumPy's global generator and PyTorch's (where imported), the
        environment's own ``np_random`` and its spaces' generators, all from ``seed``."""
        import random

        from gymnasium.utils import seeding

        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % 2**32)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.manual_seed(seed)
        env = self._env()
        env.unwrapped.np_random, _ = seeding.np_random(seed)
        env.action_space.seed(seed)
        env.observation_space.seed(seed)
        return {}

    def op_ping(self) -> dict[str, Any]:
        return {}

    def op_listen(self, token: str) -> dict[str, Any]:
        """A loopback port to go on over (see :func:`serve`)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        # others of the sandbox may connect too: a backlog of 1 let a process that
        # kept connecting hold the client's connection out (SYNs dropped, retried)
        listener.listen(MAX_PENDING)
        self.listener, self.token = listener, token.encode()
        return {"port": listener.getsockname()[1]}

    def op_close(self) -> dict[str, Any]:
        if self.env is not None:
            self.env.close()
        return {}

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.pop("op", None)
        method = getattr(self, f"op_{op}", None)
        if method is None:
            raise ValueError(f"unknown request {op!r}")
        return method(**message)


def _traceback(exc: BaseException) -> str:
    """The traceback from the environment's own frames on (this server's are noise)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


LISTEN_WAIT_S = 30.0  # how long a ``listen`` waits for its connection
HANDSHAKE_S = 5.0  # how long one connection may take to present its line
MAX_PENDING = 32  # connections presenting at once; past it the oldest is hung up on


def _accept(listener: socket.socket, token: bytes, requests: BinaryIO
            ) -> tuple[BinaryIO, BinaryIO] | None:
    """The connection that presents ``token`` as its first line (``listen``): its
    reader and writer. None when a request comes on ``requests`` first (the client
    gave up on the socket), or none came in time.

    Connections are read side by side, never one after another: one that says nothing
    (or dribbles) cannot hold the port while the client with the token waits behind
    it. Each has ``HANDSHAKE_S`` for its line, at most ``MAX_PENDING`` are heard at
    once (the oldest is hung up on first), and a wrong or overlong line is hung up on."""
    deadline = time.monotonic() + LISTEN_WAIT_S
    pending: dict[socket.socket, tuple[float, bytes]] = {}  # (its own deadline, read so far)
    listener.setblocking(False)
    try:
        while (left := deadline - time.monotonic()) > 0:
            now = time.monotonic()
            for conn, (until, _) in list(pending.items()):
                if until <= now:
                    _hang_up(pending, conn)
            soonest = min([deadline, *(until for until, _ in pending.values())])
            watched: list[Any] = [listener, requests, *pending]
            ready, _, _ = select.select(watched, [], [], max(0.0, min(left, soonest - now)))
            if requests in ready:
                return None
            if listener in ready:
                _take(listener, pending)
            for conn in ready:
                if conn in pending:
                    won = _hear(conn, token, pending)
                    if won is not None:
                        return won
        return None
    finally:
        for conn in list(pending):
            _hang_up(pending, conn)
        listener.close()


def _take(listener: socket.socket, pending: dict[socket.socket, tuple[float, bytes]]) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:  # (gone between select and accept)
        return
    conn.setblocking(False)
    if len(pending) >= MAX_PENDING:
        _hang_up(pending, next(iter(pending)))
    pending[conn] = (time.monotonic() + HANDSHAKE_S, b"")


def _hear(conn: socket.socket, token: bytes, pending: dict[socket.socket, tuple[float, bytes]]
          ) -> tuple[BinaryIO, BinaryIO] | None:
    """Read what ``conn`` sent of its first line (never past it: what follows is the
    conversation's); its reader and writer once that line is ``token``."""
    until, heard = pending[conn]
    limit = len(token) + 2
    try:
        data = conn.recv(limit - len(heard), socket.MSG_PEEK)
        end = data.find(b"\n")
        data = conn.recv(end + 1 if end >= 0 else len(data)) if data else b""
    except BlockingIOError:
        return None
    except OSError:
        data = b""
    if not data:
        _hang_up(pending, conn)
        return None
    heard += data
    if not heard.endswith(b"\n") and len(heard) < limit:
        pending[conn] = (until, heard)
        return None
    del pending[conn]
    if not hmac.compare_digest(heard.strip(), token):
        _close(conn)
        return None
    conn.setblocking(True)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn.makefile("rb"), conn.makefile("wb")


def _hang_up(pending: dict[socket.socket, tuple[float, bytes]], conn: socket.socket) -> None:
    del pending[conn]
    _close(conn)


def _close(conn: socket.socket) -> None:
    """Hang up: what the peer sent and nobody read is read first (a little, without
    waiting), so that it gets an end of file rather than a reset."""
    try:
        for _ in range(4):
            if not conn.recv(1 << 14):
                break
    except OSError:  # nothing more now (BlockingIOError), or gone
        pass
    conn.close()


def serve(requests: BinaryIO, replies: BinaryIO, wire: ModuleType) -> None:
    """Answer each request line with one reply line until ``close`` or EOF, values
    encoded with the codec ``wire``.

    ``{"op": "listen", "token": T}`` moves the conversation to a TCP socket: the reply
    names a port on the sandbox's loopback, and the first connection there whose first
    line is ``T`` carries every later request and reply (stdin and stdout fall
    silent). A request on ``requests`` before that connection keeps the conversation
    here. When that connection closes, the conversation comes back here (a live fork
    closes it first: CRIU does not checkpoint a connected TCP socket)."""
    server = EnvServer(wire)
    home = (requests, replies)
    while True:
        try:
            line = requests.readline()
        except OSError:  # a reset socket (a checkpoint resets the daemon's) ends as EOF
            line = b""
        if not line:
            if (requests, replies) == home:
                return
            for f in (requests, replies):
                try:
                    f.close()
                except OSError:
                    pass
            requests, replies = home
            continue
        if not line.strip():
            continue
        op = None
        try:
            message = wire.loads(line)
            op = message.get("op")
            reply = {"ok": True, **server.handle(message)}
            data = wire.dumps(reply)
        except Exception as exc:  # reported to the caller; the env may go on
            data = wire.dumps({"ok": False, "error": {
                "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "message": str(exc),
                "traceback": _traceback(exc),
            }})
        if op == "listen" and isinstance(listener := server.listener, socket.socket):
            server.listener = None
            replies.write(data)
            replies.flush()
            moved = _accept(listener, server.token, requests)
            if moved is not None:
                requests, replies = moved
            continue
        try:
            replies.write(data)
            replies.flush()
        except OSError:  # the socket was reset: its reader is gone, the next read says so
            if (requests, replies) == home:
                raise
        if op == "close":
            return


def main() -> None:
    # Replies get a private copy of stdout; fd 1 then points at stderr, so whatever
    # the environment prints (even from C code) cannot corrupt the protocol.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Modules in the working directory (a snapshot's /workspace/envs/...) import as with
    # `python -m`; the uploaded ones come first (see op_make).
    sys.path.insert(1, os.getcwd())
    import _corral_spaces  # type: ignore[import-not-found]  # uploaded next to this file

    serve(sys.stdin.buffer, replies, _corral_spaces)


if __name__ == "__main__":
    main()
