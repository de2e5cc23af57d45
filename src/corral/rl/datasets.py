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
  ``private_test_cases`` (JSON, or the release's packed form: base64 of zlib of a
  pickled JSON string), ``metadata`` (``func_name`` for functional tests),
  ``starter_code``. The packed form is never unpickled: its opcodes are read
  (``pickletools``) and only a pickle of one string is accepted; it unpacks to at most
  ``max_unpacked_bytes`` (:data:`MAX_UNPACKED_BYTES`, an argument of
  :func:`load_tasks` and :func:`from_livecodebench`).
- ``mbpp``: ``text`` or ``prompt``, ``test_list``, ``test_setup_code``, ``code``.
- ``humaneval``: ``prompt``, ``test``, ``entry_point``.
"""

from __future__ import annotations

import base64
import binascii
import json
import pickletools
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument
from corral.rl.stdio import IOCase, normalize_io_tests

MAX_UNPACKED_BYTES = 256 << 20
"""The most a LiveCodeBench row's packed test cases may unpack to (the largest rows of
its releases unpack to tens of MiB)."""


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


# The opcodes of a pickle of one str (protocols 0-5 write it as one of the *UNICODE ones;
# 4+ add framing and a memo entry). Anything else would build an object: refused.
_TEXT_OPS = frozenset({"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "STOP",
                       "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})


def _pickled_text(raw: bytes, where: str) -> str:
    """The string a pickle holds, read from its opcodes: nothing is unpickled."""
    text = None
    try:
        for op, arg, _ in pickletools.genops(raw):
            if op.name not in _TEXT_OPS or (isinstance(arg, str) and text is not None):
                raise InvalidArgument(f"{where} holds a pickled object ({op.name}), not text: "
                                      "only a pickle of one JSON string is read")
            if isinstance(arg, str):
                text = arg
    except ValueError as exc:  # truncated or unknown opcodes
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(f"{where} is not a valid pickle: {exc}") from None
    if text is None:
        raise InvalidArgument(f"{where} holds an empty pickle, not text")
    return text


def _unpack(value: str, where: str, limit: int) -> str:
    """base64, then zlib (at most ``limit`` bytes out), then a pickled string."""
    try:
        packed = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise InvalidArgument(f"{where} is neither JSON nor base64") from None
    unzip = zlib.decompressobj()
    try:
        raw = unzip.decompress(packed, limit + 1)
    except zlib.error:
        raise InvalidArgument(f"{where} is base64 but not zlib-compressed") from None
    if len(raw) > limit or unzip.unconsumed_tail:
        raise InvalidArgument(
            f"{where} unpacks to more than max_unpacked_bytes={limit} bytes: raise it "
            "(load_tasks(..., max_unpacked_bytes=N)) if the row is trusted",
            details={"limit": limit, "field": where},
        )
    return _pickled_text(raw, where)


def _lcb_cases(value: Any, where: str, limit: int) -> list[Mapping[str, Any]]:
    if not value:
        return []
    if isinstance(value, str) and not value.lstrip().startswith("["):
        value = _unpack(value.strip(), where, limit)
    return list(_json(value, where))


def from_livecodebench(row: Mapping[str, Any], *,
                       max_unpacked_bytes: int = MAX_UNPACKED_BYTES) -> CodeTask:
    cases = [*_lcb_cases(row.get("public_test_cases"), "public_test_cases", max_unpacked_bytes),
             *_lcb_cases(row.get("private_test_cases"), "private_test_cases", max_unpacked_bytes)]
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


def load_tasks(rows: str | Path | Iterable[Mapping[str, Any]], kind: str, *,
               max_unpacked_bytes: int = MAX_UNPACKED_BYTES) -> list[CodeTask]:
    """Tasks from a file or from rows (a ``datasets.Dataset`` iterates as dicts);
    ``max_unpacked_bytes`` bounds a LiveCodeBench row's packed cases."""
    adapter = ADAPTERS.get(kind)
    if adapter is None:
        raise InvalidArgument(f"unknown dataset kind {kind!r}: one of {', '.join(sorted(ADAPTERS))}")
    if kind == "livecodebench":
        adapter = partial(from_livecodebench, max_unpacked_bytes=max_unpacked_bytes)
    if isinstance(rows, (str, Path)):
        rows = read_rows(rows)
    return [adapter(row) for row in rows]


__all__ = [
    "ADAPTERS", "CodeTask", "MAX_UNPACKED_BYTES", "from_apps", "from_code_contests",
    "from_humaneval", "from_livecodebench", "from_mbpp", "from_taco", "load_tasks", "read_rows",
]
