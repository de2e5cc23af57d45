"""The ``corral`` command: run the daemon, and manage sandboxes on it.

Examples::

    corral serve --socket /tmp/corral.sock
    corral create --image python --memory-mb 512 --tag job=42 -n 20
    corral ls --tag job=42
    corral exec sb-1234 -- python3 -c 'print(6*7)'
    corral shell sb-1234            # bash (or sh) on a terminal in the sandbox
    corral exec -it sb-1234 -- python3
    corral cp solution.py sb-1234:/workspace/
    corral rm --tag job=42 -y
    corral pool create py256 --memory-mb 256 --min-ready 8 --max-size 64
    corral info                     # capacity, load, and the pools
    corral snapshot create sb-1234 --name with-deps
    corral create --snapshot with-deps -n 8
    corral image build env.yaml     # a base image plus cached steps
    corral eval policy.py --env CartPole-v1 --seeds 0-99
    corral token create team-a --max-sandboxes 50 --max-memory-mb 65536
    corral cluster up --address HEAD:6379   # a daemon per Ray node; CORRAL_URL=ray://HEAD:6379
    corral logs sb-1234 -f          # its commands and lifecycle, also after it ended
    corral timeout sb-1234 600      # end it 10 minutes from now
    corral doctor                   # is this machine ready to run corral?
    corral completion bash > /etc/bash_completion.d/corral

Where the daemon is: ``--url``, else ``CORRAL_URL``, else the SDK's default (the local
socket, starting the shared daemon if nothing answers; see ``corral.client._config``).
``--token``, else ``CORRAL_TOKEN``, is sent to a daemon on TCP.

Exit status: 0 on success; 1 when corral reports an error (``corral: <message>`` on
stderr); 2 for a command line that makes no sense; ``exec`` exits with the command's
own status (124 on a timeout, 137 on an out-of-memory kill), and so does ``shell``;
130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import corral
from corral.cli import (
    _cluster,
    _completion,
    _copy,
    _daemon,
    _doctor,
    _eval,
    _exec,
    _images,
    _inspect,
    _networks,
    _ops,
    _pools,
    _sandboxes,
    _shell,
    _snapshots,
    _tokens,
    _volumes,
)
from corral.cli._output import Context, UsageError
from corral.client import _validate as check_arg
from corral.client._embed import answers, daemon_missing
from corral.pool_schema import DEFAULT_MAX_SIZE, DEFAULT_MIN_READY
from corral.schema import MAX_TIMEOUT_S

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _seconds(text: str, *, optional: bool = False) -> float | None:
    """Seconds > 0 up to the daemon's maximum (30 days); ``none`` (no limit) only if
    ``optional``. ``0`` is refused, as by the SDK: it never means "no limit"."""
    if optional and text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        what = "seconds or 'none'" if optional else "seconds"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    try:
        return check_arg.timeout("timeout", value, optional=False)
    except corral.InvalidArgument:
        none = " (or 'none' for no limit)" if optional else ""
        raise argparse.ArgumentTypeError(
            f"expected seconds > 0 and <= {MAX_TIMEOUT_S:.0f}{none}, got {text!r}"
        ) from None


def _seconds_or_none(text: str) -> float | None:
    return _seconds(text, optional=True)


class _EnvAction(argparse.Action):
    """``--env K=V`` repeated: a dict."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        env = dict(getattr(namespace, self.dest, None) or {})
        name, value = values
        env[name] = value
        setattr(namespace, self.dest, env)


def _connection_options(suppress: bool) -> argparse.ArgumentParser:
    """``--url`` and ``--token``, accepted before the command and after it."""
    p = argparse.ArgumentParser(add_help=False)
    default = argparse.SUPPRESS if suppress else None
    p.add_argument(
        "--url", default=default,
        help="the daemon: unix:///path/corral.sock or http://host:port (env CORRAL_URL; "
        "default: the local socket, starting a daemon if none answers)",
    )
    p.add_argument(
        "--token", dest="client_token", default=default, metavar="TOKEN",
        help="bearer token for a daemon on TCP (env CORRAL_TOKEN)",
    )
    return p


def _add_selection(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument(
        "--tag", action="append", default=[], metavar="TAG",
        help=f"{verb} only sandboxes carrying this tag (repeat: all of them)",
    )
    p.add_argument(
        "--state", action="append", default=[], metavar="STATE",
        choices=[s.value for s in corral.SandboxState],
        help=f"{verb} only sandboxes in this state (repeat: any of them)",
    )


def _gpus(text: str) -> int | str | list[str]:
    """``--gpus``: ``2``, ``all`` or ``0,1`` / ``GPU-...``."""
    if text == "all":
        return text
    if text.isdigit():
        return int(text)
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_spec_options(p: argparse.ArgumentParser) -> None:
    """The options that make a sandbox's spec (see ``_sandboxes.spec_options``)."""
    p.add_argument("--image", help="root filesystem image (default: python)")
    p.add_argument("--cpus", type=float, help="CPU cores (default 1)")
    p.add_argument("--memory-mb", type=int, help="memory limit in MB (default 1024)")
    p.add_argument("--pids", type=int, help="process limit (default 256)")
    p.add_argument("--disk-mb", type=int, help="writable disk in MB (default 2048)")
    p.add_argument("--inodes", type=int,
                   help="files, directories and links it may write (default 131072)")
    p.add_argument("--storage", choices=("memory", "disk"),
                   help="its writable layer: a tmpfs charged to memory (default) or an "
                        "ext4 image on the host's disk")
    p.add_argument("--open-files", type=int, help="open file limit (default 1024)")
    p.add_argument("--timeout", type=_seconds, metavar="S",
                   help=f"lifetime in seconds (default 3600, at most {MAX_TIMEOUT_S:.0f})")
    p.add_argument("--idle-timeout", type=_seconds, metavar="S", help="stop after S seconds unused")
    p.add_argument("--env", type=_env_pair, action=_EnvAction, metavar="K=V", help="repeatable")
    p.add_argument("--workdir", help="working directory (default /workspace)")
    p.add_argument("--tag", action="append", metavar="T", help="repeatable, e.g. job=42")
    p.add_argument("--network", metavar="none|host|NAME",
                   help="none (default), host (admins), or a named network (corral network)")
    p.add_argument("--allow", action="append", metavar="RULE",
                   help="egress policy: allow a domain, *.domain, IP or CIDR (:PORT), or "
                   "'pypi'; repeatable (docs/network.md)")
    p.add_argument("--deny", action="append", metavar="RULE", help="egress policy: deny")
    p.add_argument("--join", metavar="NAME", help="join a private network (with the "
                   "--allow/--deny rules given; none: it reaches only the other members)")
    p.add_argument("--alias", metavar="NAME", help="with --join: the name the other members "
                   "reach it by")
    p.add_argument("--volume", dest="volumes", type=_env_pair, action=_EnvAction,
                   metavar="PATH=NAME[:MODE]", help="mount a volume (mode cow, ro or rw); "
                   "repeatable")
    p.add_argument("--gpus", type=_gpus, metavar="N|all|I,J",
                   help="NVIDIA GPUs: a count, 'all', or GPU indices/UUIDs (comma-separated)")
    p.add_argument("--gpu-shared", action="store_true", default=None,
                   help="share the GPUs with other sandboxes that share (default: exclusive)")
    p.add_argument("--checkpointable", action="store_true", default=None,
                   help="its running processes can be checkpointed (snapshot create "
                   "--live; docs/live.md)")
    p.add_argument("--on-timeout", choices=["stop", "hibernate"], default=None,
                   help="what its timeout does: stop it (default) or hibernate it (a "
                   "checkpointable sandbox; docs/live.md)")
    p.add_argument("--snapshot", metavar="S",
                   help="start on this snapshot's files (id or name; a live one's "
                   "processes run on); options left out come from the sandbox it was "
                   "taken from")


def _add_pool_commands(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pool", help="warm pools: sandboxes kept started (ls, create, rm)")
    verbs = p.add_subparsers(dest="pool_command", required=True, metavar="VERB")
    p = verbs.add_parser("ls", parents=conn, help="list pools")
    p.add_argument("-q", "--quiet", action="store_true", help="print names only")
    p.add_argument("--json", action="store_true", help="print a JSON list of pools")
    p.set_defaults(handler=_pools.ls)
    p = verbs.add_parser(
        "create", parents=conn, help="create a pool; print its name",
        description="The pool lives in the daemon until removed (or the daemon stops).",
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="default: pool-<random hex>")
    p.add_argument("--min-ready", type=int, default=DEFAULT_MIN_READY, metavar="N",
                   help=f"sandboxes kept ready (default {DEFAULT_MIN_READY})")
    p.add_argument("--max-size", type=int, default=DEFAULT_MAX_SIZE, metavar="N",
                   help=f"most sandboxes at once, handed out ones included (default {DEFAULT_MAX_SIZE})")
    _add_spec_options(p)
    p.add_argument("--json", action="store_true", help="print the pool as JSON")
    p.set_defaults(handler=_pools.create)
    p = verbs.add_parser("rm", parents=conn, help="delete pools and their ready sandboxes")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.set_defaults(handler=_pools.rm)


def _add_snapshot_commands(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("snapshot", help="snapshots: a sandbox's files, to start copies from "
                       "(create, ls, rm)")
    verbs = p.add_subparsers(dest="snapshot_command", required=True, metavar="VERB")
    p = verbs.add_parser("create", parents=conn, help="snapshot a sandbox; print the id")
    p.add_argument("id", metavar="ID", help="the sandbox")
    p.add_argument("--name", metavar="N", help="a unique name to use instead of the id")
    p.add_argument("--live", action="store_true",
                   help="its running processes too (a checkpointable sandbox; docs/live.md)")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    p.set_defaults(handler=_snapshots.create)
    p = verbs.add_parser("ls", parents=conn, help="list snapshots")
    p.add_argument("-q", "--quiet", action="store_true", help="print ids only")
    p.add_argument("--json", action="store_true", help="print a JSON list of snapshots")
    p.set_defaults(handler=_snapshots.ls)
    p = verbs.add_parser(
        "rm", parents=conn, help="delete snapshots (sandboxes started from them keep running)"
    )
    p.add_argument("refs", nargs="+", metavar="ID_OR_NAME")
    p.set_defaults(handler=_snapshots.rm)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corral", parents=[_connection_options(suppress=False)],
        description="Self-hosted sandboxes for reinforcement learning.",
        epilog="Run 'corral COMMAND -h' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"corral {corral.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    conn = [_connection_options(suppress=True)]

    # The daemon's options are parsed by the parser of `python -m corral.server` (see
    # _serve), which is imported only then: the server is slow to import.
    p = sub.add_parser(
        "serve", add_help=False, help="run the daemon (the options of python -m corral.server)"
    )

    p = sub.add_parser(
        "create", parents=conn, help="create sandboxes; print their ids",
        description="All or nothing: if any of the -n creates fails, those made are "
        "deleted again (the message lists them), nothing is printed and the exit status is 1.",
    )
    _add_spec_options(p)
    p.add_argument("-n", dest="count", type=int, default=1, metavar="COUNT",
                   help="how many to create, concurrently (default 1)")
    p.add_argument("--json", action="store_true", help="print a JSON list of the sandboxes")
    p.set_defaults(handler=_sandboxes.create)

    p = sub.add_parser("ls", parents=conn, help="list sandboxes")
    _add_selection(p, "list")
    p.add_argument("-q", "--quiet", action="store_true", help="print ids only")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.set_defaults(handler=_sandboxes.ls)
    _inspect.add_parser(sub, conn)
    _tokens.add_parser(sub, conn)

    p = sub.add_parser(
        "exec", parents=conn, help="run a command in a sandbox, streaming its output",
        usage="corral exec ID [options] -- CMD...",
        description="Several CMD arguments run as argv, and so does one plain word "
        "(/bin/hello, ls); one argument with shell syntax (spaces, $, ;, |, ...) runs "
        "through /bin/sh -c. "
        "Exits with the command's status: 124 on timeout, 137 when killed for memory.",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("cmd", nargs="+", metavar="CMD")
    p.add_argument("--timeout", type=_seconds_or_none, metavar="S",
                   help="kill the command after S seconds (default: none, no limit; "
                   "0 is refused)")
    p.add_argument("--env", type=_env_pair, action=_EnvAction, metavar="K=V", help="repeatable")
    p.add_argument("--cwd", metavar="DIR", help="working directory (default: the workdir)")
    p.add_argument("--user", "-u", metavar="USER",
                   help="root, or the sandbox user (default: the image's USER, else the "
                   "sandbox user; docs/users.md)")
    p.add_argument("--stdin-file", metavar="FILE",
                   help="feed this file (or - for our stdin, read to its end) to the command")
    p.add_argument("--max-output", type=_exec.byte_count, metavar="BYTES",
                   help="bytes kept of each stream (default 1M); past that, its head and its tail")
    p.add_argument("--output-tail", type=_exec.byte_count, metavar="BYTES",
                   help="of --max-output, bytes kept from the end of each stream "
                   "(default: half, at most 8M; 0: the head only)")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="send our stdin to the command as it comes (end of input closes its stdin)")
    p.add_argument("-t", "--tty", action="store_true",
                   help="run it on a terminal in the sandbox, this one in raw mode (Ctrl-C "
                   "goes there; needs a terminal on stdin); with -i to type into it")
    p.set_defaults(handler=_shell.exec_command)

    p = sub.add_parser(
        "shell", parents=conn, help="an interactive shell (or CMD) on a terminal in a sandbox",
        usage="corral shell ID [options] [-- CMD...]",
        description="Runs bash, or sh if the image has no bash (or CMD; one argument with "
        "shell syntax runs through /bin/sh -c), on a pseudo-terminal in the sandbox, this terminal in raw "
        "mode until it exits: keys, Ctrl-C included, go there, and resizing the window "
        "resizes it. Exits with its status. "
        "Needs a terminal (to pipe input: corral exec -i ID -- sh).",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("cmd", nargs="*", metavar="CMD")
    p.add_argument("--env", type=_env_pair, action=_EnvAction, metavar="K=V", help="repeatable")
    p.add_argument("--cwd", metavar="DIR", help="working directory (default: the workdir)")
    p.add_argument("--user", "-u", metavar="USER",
                   help="root, or the sandbox user (default: the image's USER, else the "
                   "sandbox user; docs/users.md)")
    p.set_defaults(handler=_shell.shell_command)

    p = sub.add_parser(
        "cp", parents=conn, help="copy files or directories into or out of a sandbox",
        description=_copy.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="local path, - (stdin), or ID:PATH")
    p.add_argument("dst", metavar="DST", help="local path, - (stdout), or ID:PATH")
    p.set_defaults(handler=_copy.cp)

    for name, handler, what in (
        ("pause", _sandboxes.pause, "freeze sandboxes (they keep their memory)"),
        ("resume", _sandboxes.resume, "thaw paused sandboxes, restore hibernated ones"),
        ("hibernate", _sandboxes.hibernate, "write checkpointable sandboxes' processes to "
         "disk and free their memory (resume or their next use restores them)"),
        ("stop", _sandboxes.stop, "stop sandboxes' processes (they stay listed until rm)"),
    ):
        p = sub.add_parser(name, parents=conn, help=what)
        p.add_argument("ids", nargs="+", metavar="ID")
        p.set_defaults(handler=handler)
    sub.choices["stop"].add_argument("--grace", type=float, metavar="S",
                   help="seconds between SIGTERM and SIGKILL (default: the daemon's)")

    p = sub.add_parser(
        "rm", parents=conn, help="delete sandboxes, by id or by tag",
        usage="corral rm ID...\n       corral rm --tag TAG [--tag ...] [--state ...] [-y]",
        description="Deleting is idempotent, as in the API: an ID that names no sandbox "
        "(deleted already, or never made) is noted on stderr, not an error. Deleting by "
        "--tag/--state asks first on a terminal; elsewhere (a script) it needs -y.",
    )
    p.add_argument("ids", nargs="*", metavar="ID")
    _add_selection(p, "delete")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask before deleting by tag")
    p.set_defaults(handler=_sandboxes.rm)

    p = sub.add_parser("info", parents=conn, help="the daemon's version, capacity, load and pools")
    p.add_argument("--json", action="store_true", help="print the daemon's reply as JSON")
    p.set_defaults(handler=_sandboxes.info)
    _add_pool_commands(sub, conn)
    _add_snapshot_commands(sub, conn)
    _images.add_commands(sub, conn)
    _daemon.add_commands(sub, conn)
    _cluster.add_commands(sub)
    _eval.add_parser(sub, conn)
    _ops.add_commands(sub, conn, _seconds)
    _volumes.add_commands(sub, conn)
    _networks.add_commands(sub, conn)
    _doctor.add_parser(sub, conn)
    _completion.add_parser(sub, build_parser)
    _plain_help(parser)
    return parser


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Drop the reST ````literal```` markup of descriptions taken from docstrings: a
    terminal shows it raw. Walks every subcommand's parser."""
    if parser.description:
        parser.description = parser.description.replace("``", "")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _plain_help(sub)


def _serve(args: argparse.Namespace, server_argv: list[str]) -> int:
    why = daemon_missing()
    if why is not None:
        raise corral.Unsupported(f"corral serve: {why}")
    from corral.server.__main__ import build_parser as build_server_parser
    from corral.server.__main__ import settings_from_args
    from corral.server.daemon import serve

    server_args = build_server_parser("corral serve").parse_args(server_argv)
    if server_args.token is None:  # `corral --token T serve` means `corral serve --token T`
        server_args.token = args.client_token
    settings = settings_from_args(server_args)
    if answers(settings.socket):  # e.g. the daemon the SDK started (embedded)
        raise corral.InvalidState(
            f"{_daemon.describe(str(settings.socket))}, then run corral serve again; or "
            "give this one another --socket and --state-dir"
        )
    try:
        serve(settings)
    except corral.InvalidState as exc:  # another engine holds the state directory
        raise corral.InvalidState(
            f"{exc.message}; to see the daemon on a socket: corral daemon status "
            "[--url unix:///path.sock], to stop it: corral daemon stop",
            details=exc.details,
        ) from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``corral`` command line; return its exit status."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        hint = (
            f" (give the command after --: corral {args.command} ID -- CMD...)"
            if args.command in ("exec", "shell") else ""
        )
        parser.error(f"unrecognized arguments: {' '.join(rest)}{hint}")
    ctx = Context(args.url, args.client_token)
    try:
        if args.command == "serve":
            return _serve(args, rest)
        return args.handler(args, ctx)
    except UsageError as exc:
        ctx.output.error(f"{args.command}: {exc}")
        return EXIT_USAGE
    except corral.CorralError as exc:
        ctx.output.error(exc.message)
        return EXIT_ERROR
    except OSError as exc:  # a local file of cp or --stdin-file
        ctx.output.error(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        ctx.output.error("interrupted")
        return EXIT_INTERRUPTED
    finally:
        ctx.close()


if __name__ == "__main__":
    sys.exit(main())
