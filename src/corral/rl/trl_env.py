"""A sandbox per rollout for TRL's ``GRPOTrainer(environment_factory=...)``.

TRL (>= 1.0, experimental there) builds environment instances with
``environment_factory()`` — no arguments — and keeps them in a pool, reusing one per
rollout: it calls ``reset(**row)`` with the dataset row before generation, exposes the
instance's public methods as tools the model may call (their type hints and Google
docstrings become the tool schema), and calls ``get_reward()`` once the rollout is
done. :class:`SandboxToolEnv` gives every rollout ONE persistent sandbox:

- ``reset`` deletes the previous rollout's sandbox (if any) and starts a fresh one in
  the background, so the resets of a batch create their sandboxes concurrently;
- ``bash``, ``read_file``, ``write_file`` and ``run_tests`` act on that sandbox, so a
  file written by one tool call is there for the next;
- ``get_reward`` runs the row's hidden tests (column ``tests``, the format of
  :mod:`corral.rl.code`) on the solution file, then deletes the sandbox. It returns
  ``None`` when the infrastructure failed, never 0.0.

Nothing outlives its rollout: besides ``get_reward``, an instance's sandbox is deleted
when the instance is garbage-collected or the process exits, and
:meth:`SandboxToolEnv.close_all` deletes those of every live instance. (A public
``close`` method would become a tool the model could call, hence the class method.)

::

    from functools import partial
    from corral.rl import SandboxToolEnv

    trainer = GRPOTrainer(
        model=..., train_dataset=dataset,                      # columns: prompt, tests
        environment_factory=partial(SandboxToolEnv, image="python", mode="fraction"),
    )
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from corral.client._futures import Handle
from corral.client._models import spec_body
from corral.client._sync import Client, Sandbox
from corral.errors import FileNotFound, InvalidArgument, InvalidState, SandboxProtocolError
from corral.rl._grading import Grading, check_grading
from corral.rl._judging import Mode, judge_file, parse_tests, score
from corral.rl.code import TestReport, clip, render_result
from corral.rl.episodes import INFRA_ERRORS
from corral.rl.stdio import IOCase

log = logging.getLogger(__name__)

DEFAULT_LIFETIME_S = 3600.0
DEFAULT_EXEC_TIMEOUT_S = 30.0
DEFAULT_MAX_OUTPUT_CHARS = 4000


class _Slot:
    """The sandbox of one instance, held apart from it so a finalizer can delete it
    without keeping the instance alive."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: Handle[Sandbox] | None = None
        self.sandbox: Sandbox | None = None

    def take(self) -> Handle[Sandbox] | Sandbox | None:
        with self.lock:
            held = self.sandbox or self.pending
            self.sandbox = self.pending = None
            return held


def _delete(held: Handle[Sandbox] | Sandbox | None) -> None:
    """Delete a sandbox, or the one a pending create will return; never raises."""
    if held is None:
        return
    try:
        sb = held.result() if isinstance(held, Handle) else held
    except Exception:  # the create failed: nothing to delete
        return
    try:
        sb.delete()
    except Exception as exc:  # the daemon reaps it at the end of its lifetime
        log.warning("could not delete sandbox %s: %s", sb.id, exc)


class SandboxToolEnv:
    """One persistent sandbox per rollout, with tools for the model and a test reward.

    Arguments (all keyword; pass them with :func:`functools.partial` since TRL calls
    the factory without arguments): ``image``, ``memory_mb``, ``cpus``, ``lifetime``
    (seconds before the daemon stops a forgotten sandbox), ``exec_timeout`` (seconds a
    ``bash`` or ``run_tests`` call may take), ``test_timeout`` (per test),
    ``mode`` (``"fraction"`` or ``"binary"``), ``tests_column`` (the dataset column
    with the hidden tests), ``solution_path`` (the file the tests load, relative to
    ``/workspace``), ``files`` (``{path: content}`` written into every new sandbox),
    ``instructions`` (text ``reset`` returns, which TRL appends to the prompt),
    ``max_output`` (characters of tool output returned to the model), ``url``
    (the daemon), ``tags``.
    """

    _live: ClassVar[weakref.WeakSet[SandboxToolEnv]] = weakref.WeakSet()

    def __init__(
        self,
        *,
        image: str = "python",
        memory_mb: int = 512,
        cpus: float | None = None,
        lifetime: float = DEFAULT_LIFETIME_S,
        exec_timeout: float = DEFAULT_EXEC_TIMEOUT_S,
        test_timeout: float | None = None,
        grading: Grading = "auto",
        mode: Mode = "fraction",
        tests_column: str = "tests",
        solution_path: str = "solution.py",
        files: Mapping[str, str | bytes] | None = None,
        instructions: str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT_CHARS,
        url: str | None = None,
        tags: Sequence[str] = (),
    ) -> None:
        if mode not in ("binary", "fraction"):
            raise InvalidArgument(f"mode must be 'binary' or 'fraction', got {mode!r}")
        if not exec_timeout > 0:
            raise InvalidArgument(f"exec_timeout must be positive, got {exec_timeout!r}")
        self._spec = spec_body({
            "image": image, "memory_mb": memory_mb, "cpus": cpus, "timeout": lifetime,
            "tags": ["corral.rl", "trl-env", *tags],
        })
        self.mode: Mode = mode
        self.exec_timeout = float(exec_timeout)
        self.test_timeout = test_timeout
        check_grading(grading)
        self.grading: Grading = grading
        self.tests_column = tests_column
        self.solution_path = solution_path
        self.files = dict(files or {})
        self.instructions = instructions
        self.max_output = max_output
        self._client = Client(url) if url is not None else None
        self._slot = _Slot()
        self._tests: list[str] | list[IOCase] = []
        self._entry_point: str | None = None
        self._language: str | None = None
        self._reward: float | None = None
        self._scored = False
        self.last_report: TestReport | None = None
        self.rollouts = 0
        self.sandbox_ids: list[str] = []
        self._finalizer = weakref.finalize(self, _delete_slot, self._slot)
        SandboxToolEnv._live.add(self)

    # ----------------------------------------------------------------- TRL hooks

    def reset(self, **row: Any) -> str | None:
        """Start a rollout: a fresh sandbox (the previous one is deleted); the row's
        tests are kept for ``get_reward``. Returns ``instructions`` (or ``None``)."""
        _delete(self._slot.take())
        if self.tests_column not in row:
            raise InvalidArgument(
                f"SandboxToolEnv.reset: the row has no {self.tests_column!r} column "
                f"(columns: {sorted(row)}); add the hidden tests there or pass tests_column="
            )
        self._tests = parse_tests(row[self.tests_column], self.tests_column)
        self._entry_point = row.get("entry_point") or None
        self._language = row.get("language") or None
        self._reward, self._scored, self.last_report = None, False, None
        self.rollouts += 1
        kwargs = dict(self._spec)
        if self._client is not None:
            kwargs["client"] = self._client
        self._slot.pending = Sandbox.create_future(**kwargs)
        return self.instructions

    def get_reward(self) -> float | None:
        """Run the hidden tests on the solution file and delete the sandbox.

        The fraction of tests passed (or 1.0/0.0 with ``mode="binary"``); ``None`` if
        the sandbox or the daemon failed. Asking twice gives the same answer.
        """
        if self._scored:
            return self._reward
        self._scored = True
        try:
            sb = self._sandbox()
            report = self._judge(sb)
        except SandboxProtocolError as exc:  # the rollout broke its sandbox: it fails
            log.info("rollout broke its sandbox (%s): reward 0.0", exc)
            self._reward = 0.0
        except INFRA_ERRORS as exc:
            log.warning("rollout not scored (%s: %s): reward None", type(exc).__name__, exc)
            self._reward = None
        else:
            self.last_report = report
            self._reward = score(report, self.mode)
            if self._reward is None:
                log.warning("rollout in %s is not gradable (%s): reward None", sb.id, report.reason)
            elif report.timed_out:
                log.info("rollout in %s: %s: reward %.3g", sb.id, report.reason, self._reward)
        finally:
            _delete(self._slot.take())
        return self._reward

    # --------------------------------------------------------------------- tools

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox (working directory /workspace).

        Args:
            command: The shell command line to run, e.g. "python3 solution.py".

        Returns:
            The exit code, then what the command printed on stdout and stderr.
        """
        result = self._sandbox().exec(command, timeout=self.exec_timeout)
        return render_result(result, self.max_output)

    def read_file(self, path: str) -> str:
        """Read a text file from the sandbox.

        Args:
            path: The file's path, absolute or relative to /workspace.

        Returns:
            The file's content, or an error message if it cannot be read.
        """
        try:
            data = self._sandbox().files.read(path)
        except FileNotFound:
            return f"error: no such file: {path}"
        except InvalidArgument as exc:
            return f"error: {exc}"
        return clip(data.decode(errors="replace"), self.max_output)

    def write_file(self, path: str, content: str) -> str:
        """Create or replace a file in the sandbox (parent directories are created).

        Args:
            path: The file's path, absolute or relative to /workspace.
            content: The complete new content of the file.

        Returns:
            A confirmation with the number of bytes written, or an error message.
        """
        data = content.encode()
        try:
            self._sandbox().files.write(path, data)
        except (InvalidArgument, FileNotFound) as exc:
            return f"error: {exc}"
        return f"wrote {len(data)} bytes to {path}"

    def run_tests(self) -> str:
        """Run the task's hidden tests on the solution file and report the results.

        Returns:
            How many tests passed, with the errors of those that failed.
        """
        return clip(self._judge(self._sandbox()).feedback(), self.max_output)

    def _judge(self, sb: Sandbox) -> TestReport:
        return judge_file(
            sb, self._tests, self.solution_path, timeout=self.exec_timeout,
            test_timeout=self.test_timeout, grading=self.grading,
            entry_point=self._entry_point, language=self._language,
        )

    # ---------------------------------------------------------------- lifecycle

    @property
    def sandbox_id(self) -> str | None:
        """The current rollout's sandbox, if it has been started and not deleted."""
        sb = self._slot.sandbox
        return sb.id if sb is not None else None

    def _sandbox(self) -> Sandbox:
        """The rollout's sandbox, waiting for its creation to finish if needed."""
        slot = self._slot
        with slot.lock:
            if slot.sandbox is None and slot.pending is not None:
                pending, slot.pending = slot.pending, None
                slot.sandbox = pending.result()  # a failed create raises its error here
                self.sandbox_ids.append(slot.sandbox.id)
                self._write_files(slot.sandbox)
            if slot.sandbox is None:
                raise InvalidState(
                    "this environment has no sandbox: call reset() to start a rollout "
                    "(get_reward() ends one and deletes its sandbox)"
                )
            return slot.sandbox

    def _write_files(self, sb: Sandbox) -> None:
        for path, content in self.files.items():
            sb.files.write(path, content)

    @classmethod
    def close_all(cls) -> int:
        """Delete the sandboxes of every live instance; returns how many there were."""
        held = [env._slot.take() for env in list(cls._live)]
        for h in held:
            _delete(h)
        return sum(1 for h in held if h is not None)

    def __enter__(self) -> SandboxToolEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        _delete(self._slot.take())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} sandbox={self.sandbox_id} rollouts={self.rollouts}>"


def _delete_slot(slot: _Slot) -> None:
    _delete(slot.take())
