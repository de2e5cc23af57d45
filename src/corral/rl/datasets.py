"""Code datasets as judge tasks: APPS, TACO, CodeContests, LiveCodeBench, MBPP, HumanEval.

Rows come from local files (``.jsonl``, ``.json``; ``.parquet`` with ``pyarrow``) or a
``datasets.Dataset`` the user already loaded: nothing is downloaded. Each row becomes a
:class:`CodeTask`, whose :meth:`CodeTask.row` is what :func:`corral.rl.code_reward`
reads (``prompt``, ``tests``, ``entry_point``, ``language``)::

    from corral.rl.datasets import load_tasks
    tasks = load_tasks("code_contests.jsonl", "code_contests")
    train = datasets.Dataset.from_list([t.row() for t in tasks])
    reward = code_reward("fraction")          # stdin/stdout rows run on the judge image

Row shapes (the fields each adapter reads):

- ``apps`` / ``taco``: ``question``, ``input_output`` (JSON: ``inputs``, ``outputs``,
  and ``fn_name`` for call-based problems), ``starter_code``.
- ``code_contests``: ``description``, ``public_tests`` / ``private_tests`` /
  ``generated_tests`` (``{"input": [...], "output": [...]}``), ``time_limit``
  (``{"seconds", "nanos"}``), ``memory_limit_bytes``.
- ``livecodebench``: ``question_content``, ``public_test_cases`` /
  ``private_test_cases`` (JSON, or the release's base64+zlib form), ``metadata``
  (``func_name`` for functional tests), ``starter_code``.
- ``mbpp``: ``text`` or ``prompt``, ``test_list``, ``test_setup_code``, ``code``.
- ``humaneval``: ``prompt``, ``test``, ``entry_point``.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument
from corral.rl.stdio import IOCase, normalize_io_tests


@dataclass(frozen=True)
class CodeTask:
    """One problem: its prompt and its tests, Python snippets or stdin/stdout cases."""

    id: str
    prompt: str
    tests: list[str] | list[IOCase]
    entry_point: str | None = None
    language: str | None = None
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def io(self) -> bool:
        return bool(self.tests) and isinstance(self.tests[0], IOCase)

    def row(self) -> dict[str, Any]:
        """The task as a dataset row for :func:`corral.rl.code_reward` (plain data)."""
        tests: list[Any] = [
            {"input": c.input, "output": c.output, "time_limit": c.time_limit,
             "memory_mb": c.memory_mb} if isinstance(c, IOCase) else c
            for c in self.tests
        ]
        return {"id": self.id, "prompt": self.prompt, "tests": tests,
                "entry_point": self.entry_point or "", "language": self.language or ""}


def _json(value: Any, where: str) -> Any:
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError:
            raise InvalidArgument(f"{where} is not JSON") from None
    return value


def _call_tests(fn_name: str, inputs: list[Any], outputs: list[Any], cls: bool) -> list[str]:
    """Call-based problems (APPS/TACO ``fn_name``, LeetCode style) as Python tests."""
    target = f"Solution().{fn_name}" if cls else fn_name
    tests = []
    for args, want in zip(inputs, outputs, strict=True):
        args = args if isinstance(args, list) else [args]
        tests.append(
            f"_got = {target}(*{args!r})\n"
            f"_got = list(_got) if type(_got) is tuple else _got\n"
            f"_want = {want!r}\n"
            "assert _got == _want or [_got] == _want"
        )
    return tests


def _limits(seconds: float | None, memory_mb: int | None, cases: list[IOCase]) -> list[IOCase]:
    return [IOCase(c.input, c.output, seconds or c.time_limit, memory_mb or c.memory_mb)
            for c in cases]


def from_apps(row: Mapping[str, Any], *, source: str = "apps") -> CodeTask:
    """An APPS (or TACO: same shape) row."""
    io_spec = _json(row.get("input_output") or "{}", "input_output")
    ins, outs = io_spec.get("inputs") or [], io_spec.get("outputs") or []
    starter = str(row.get("starter_code") or "")
    fn = io_spec.get("fn_name")
    rid = str(row.get("problem_id", row.get("id", "")))
    if fn:
        tests: list[Any] = _call_tests(fn, ins, outs, "class Solution" in starter)
    else:
        tests = normalize_io_tests({"inputs": ins, "outputs": outs}, where=f"{source} {rid}")
    prompt = str(row.get("question", ""))
    if starter:
        prompt += f"\n\nStart from:\n{starter}"
    return CodeTask(rid, prompt, tests, entry_point=fn or None, language="python" if fn else None,
                    source=source)


def from_taco(row: Mapping[str, Any]) -> CodeTask:
    return from_apps(row, source="taco")


def from_code_contests(row: Mapping[str, Any]) -> CodeTask:
    cases: list[IOCase] = []
    for key in ("public_tests", "private_tests", "generated_tests"):
        part = row.get(key)
        if part and part.get("input"):
            cases += normalize_io_tests(part, where=key)
    tl = row.get("time_limit") or {}
    seconds = (tl.get("seconds") or 0) + (tl.get("nanos") or 0) / 1e9 if isinstance(tl, Mapping) else None
    mem = row.get("memory_limit_bytes")
    return CodeTask(str(row.get("name", "")), str(row.get("description", "")),
                    _limits(seconds or None, int(mem) >> 20 if mem else None, cases),
                    source="code_contests")


class _TextOnly(pickle.Unpickler):
    """LiveCodeBench's private cases are a pickled JSON string: nothing else loads."""

    def find_class(self, module: str, name: str) -> Any:
        raise InvalidArgument("private_test_cases holds a pickled object, not text")


def _lcb_cases(value: Any) -> list[Mapping[str, Any]]:
    if not value:
        return []
    if isinstance(value, str) and not value.lstrip().startswith("["):
        try:
            raw = zlib.decompress(base64.b64decode(value))
            value = _TextOnly(io.BytesIO(raw)).load()
        except InvalidArgument:
            raise
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError):
            raise InvalidArgument("private_test_cases is neither JSON nor base64+zlib") from None
    return list(_json(value, "test cases"))


def from_livecodebench(row: Mapping[str, Any]) -> CodeTask:
    cases = _lcb_cases(row.get("public_test_cases")) + _lcb_cases(row.get("private_test_cases"))
    meta = _json(row.get("metadata") or "{}", "metadata")
    rid = str(row.get("question_id", ""))
    prompt = str(row.get("question_content", ""))
    starter = str(row.get("starter_code") or "")
    if starter:
        prompt += f"\n\nStart from:\n{starter}"
    if cases and all(c.get("testtype") == "functional" for c in cases):
        fn = meta.get("func_name")
        if not fn:
            raise InvalidArgument(f"livecodebench {rid}: functional tests but no metadata.func_name")
        ins = [[json.loads(a) for a in str(c["input"]).split("\n") if a.strip()] for c in cases]
        outs = [json.loads(c["output"]) for c in cases]
        return CodeTask(rid, prompt, _call_tests(fn, ins, outs, "class Solution" in starter),
                        entry_point=fn, language="python", source="livecodebench")
    return CodeTask(rid, prompt, normalize_io_tests(cases, where=f"livecodebench {rid}"),
                    source="livecodebench")


_CALLED = re.compile(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(")


def from_mbpp(row: Mapping[str, Any]) -> CodeTask:
    setup = str(row.get("test_setup_code") or "")
    tests = [f"{setup}\n{t}" if setup else str(t) for t in row.get("test_list") or []]
    m = re.search(r"^def\s+([A-Za-z_]\w*)", str(row.get("code") or ""), re.M)
    entry = m.group(1) if m else None
    if entry is None and tests:
        called = _CALLED.search(tests[0])
        entry = called.group(1) if called else None
    prompt = str(row.get("prompt") or row.get("text") or "")
    if tests:
        prompt += f"\nYour code should pass this test:\n{tests[0]}"
    return CodeTask(str(row.get("task_id", "")), prompt, tests, entry_point=entry,
                    language="python", source="mbpp")


def from_humaneval(row: Mapping[str, Any]) -> CodeTask:
    entry = str(row["entry_point"])
    test = f"{row['test']}\ncheck({entry})\n"
    return CodeTask(str(row.get("task_id", "")), str(row["prompt"]), [test], entry_point=entry,
                    language="python", source="humaneval")


ADAPTERS: dict[str, Callable[[Mapping[str, Any]], CodeTask]] = {
    "apps": from_apps, "taco": from_taco, "code_contests": from_code_contests,
    "livecodebench": from_livecodebench, "mbpp": from_mbpp, "humaneval": from_humaneval,
}


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl``, ``.json`` (a list) or ``.parquet`` file."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-untyped]
        except ImportError:
            raise InvalidArgument("reading .parquet needs pyarrow: pip install pyarrow") from None
        return list(pq.read_table(path).to_pylist())
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_tasks(rows: str | Path | Iterable[Mapping[str, Any]], kind: str) -> list[CodeTask]:
    """Tasks from a file or from rows (a ``datasets.Dataset`` iterates as dicts)."""
    adapter = ADAPTERS.get(kind)
    if adapter is None:
        raise InvalidArgument(f"unknown dataset kind {kind!r}: one of {', '.join(sorted(ADAPTERS))}")
    if isinstance(rows, (str, Path)):
        rows = read_rows(rows)
    return [adapter(row) for row in rows]


__all__ = [
    "ADAPTERS", "CodeTask", "from_apps", "from_code_contests", "from_humaneval",
    "from_livecodebench", "from_mbpp", "from_taco", "load_tasks", "read_rows",
]
