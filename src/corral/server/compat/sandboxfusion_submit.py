"""SandboxFusion's ``/submit`` for stdin/stdout test cases, judged by corral's judge.

SandboxFusion evaluates a completion against a dataset's tests with ``POST /submit``
(``sandbox_fusion.submit``); for a dataset it does not know, the tests come in the
request: ``config.provided_data = {"test": [{"input": {"stdin": ...}, "output":
{"stdout": ...}}, ...]}``. Here they are judged by the stdin/stdout judge
(:mod:`corral.guest.io_judge`, docs/grading.md) in one fresh sandbox of the ``judge``
image: compiled once, every case under its limit, the expected outputs only in the
judge's memory. ``run_code`` and its languages are untouched; ``/submit`` accepts the
languages both know (python, cpp, nodejs/js, go, java, rust).

The answer is SandboxFusion's ``EvalResult``: ``accepted``, the extracted code, and per
case ``passed`` with an ``exec_info`` (``RunCodeResponse``) and ``test_info`` carrying
corral's verdict (``AC``, ``WA``, ``PE``, ``PC``, ``TLE``, ``MLE``, ``RE``, ``CE``, ``IE``).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from corral.errors import InvalidArgument, Unsupported
from corral.guest import program
from corral.server.compat.sandboxfusion_model import (
    FAILED,
    FINISHED,
    MAX_TIMEOUT_S,
    SUCCESS,
    TLE,
    code_response,
)

JUDGE_IMAGE = "judge"
JUDGE_MEMORY_MB = 1536
MAX_REQUEST = 1 << 20  # bytes of tests one /submit may carry (they go on the judge's stdin)
LANGUAGES = {"python": "python", "cpp": "cpp", "nodejs": "javascript", "js": "javascript",
             "go": "go", "java": "java", "rust": "rust"}
READY = "corral-judge-ready"
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n(.*?)```", re.S)


class SubmitConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    language: str | None = None
    compile_timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    run_timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    provided_data: dict[str, Any] | list[dict[str, Any]] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    dataset: str
    id: int | str
    completion: str
    config: SubmitConfig


def extract(completion: str) -> tuple[str, str]:
    """The last fenced block (``fenced``), or the whole completion (``heuristic``)."""
    blocks = _FENCE.findall(completion)
    if blocks:
        return blocks[-1][1], "fenced"
    return completion, "heuristic"


def judge_request(req: SubmitRequest) -> tuple[str, list[dict[str, str]], bytes, str]:
    """``(language, cases, the judge's request line, nonce)``; :class:`InvalidArgument`
    or :class:`Unsupported` for what cannot be judged (a ``SandboxError`` reply)."""
    cfg = req.config
    lang = LANGUAGES.get(cfg.language or "python")
    if lang is None:
        raise Unsupported(f"/submit judges {', '.join(sorted(LANGUAGES))}, not {cfg.language!r}")
    data = cfg.provided_data
    tests = data.get("test") if isinstance(data, dict) else None
    if not isinstance(tests, list) or not tests:
        raise InvalidArgument("config.provided_data.test must be a list of "
                              "{'input': {'stdin': ...}, 'output': {'stdout': ...}}")
    cases = []
    for i, t in enumerate(tests):
        try:
            cases.append({"input": str(t["input"].get("stdin", "")),
                          "output": str(t["output"]["stdout"])})
        except (KeyError, TypeError, AttributeError):
            raise InvalidArgument(f"config.provided_data.test[{i}] has no input.stdin / "
                                  "output.stdout") from None
    code, _ = extract(req.completion)
    nonce = "corral-verdict-" + secrets.token_hex(16)
    body = {
        "nonce": nonce, "language": lang, "code": code, "tests": cases,
        "time_limit": cfg.run_timeout or 10.0, "memory_mb": 256,
        "compare": cfg.extra.get("compare", "tokens"), "tolerance": 1e-6, "checker": None,
        "stop_on_failure": False, "output_limit": 16 << 20,
    }
    line = json.dumps(body).encode() + b"\n"
    if len(line) > MAX_REQUEST:
        raise InvalidArgument(f"the tests are {len(line)} bytes; /submit takes at most {MAX_REQUEST}")
    return lang, cases, line, nonce


def judge_argv() -> list[str]:
    return ["python3", "-I", "-c", program("confine", "case_memory", "io_judge")]


def eval_result(req: SubmitRequest, cases: list[dict[str, str]], stdout: str, nonce: str,
                timed_out: bool) -> dict[str, Any]:
    """SandboxFusion's ``EvalResult`` from the judge's report (every case failed, with
    the reason, when it gave none)."""
    code, kind = extract(req.completion)
    report = None
    for line in stdout.splitlines():
        if line.startswith(nonce):
            try:
                report = json.loads(line[len(nonce):])
            except ValueError:
                report = None
    rows = report.get("tests") if isinstance(report, dict) else None
    if not isinstance(rows, list) or len(rows) != len(cases):
        why = "the judge ran past its time" if timed_out else "the judge gave no report"
        rows = [["IE", 0.0, 0, why]] * len(cases)
    compiled = report.get("compile") if isinstance(report, dict) else None
    tests = []
    for case, row in zip(cases, rows, strict=True):
        verdict, cpu, _, note = (list(row) + [None] * 4)[:4]
        run = {"status": TLE if verdict == "TLE" else FINISHED, "execution_time": cpu,
               "return_code": 0 if verdict in ("AC", "WA", "PE", "PC") else 1, "stdout": "",
               "stderr": str(note or "")}
        tests.append({
            "passed": verdict == "AC",
            "exec_info": code_response(SUCCESS if verdict == "AC" else FAILED, str(note or ""),
                                       run_result=run),
            "test_info": {"input": {"stdin": case["input"]}, "verdict": verdict},
        })
    return {
        "id": req.id, "accepted": bool(tests) and all(t["passed"] for t in tests),
        "extracted_code": code, "extracted_type": kind, "full_code": None, "test_code": None,
        "tests": tests,
        "extra": {"verdicts": [t["test_info"]["verdict"] for t in tests],
                  "compile": compiled if isinstance(compiled, list) else None},
    }
