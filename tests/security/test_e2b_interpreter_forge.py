"""A Code Interpreter cell writes to the kernel's protocol channel itself (it runs in
the kernel's process, so it can): it may shape its own output, never the fields that
are not its output (the execution count, other result formats, the client's charts
and extras) and never the end of its execution. Checked with the real client."""

from __future__ import annotations

import pytest

from tests.server.test_compat_e2b import checked, run_script, serving

pytest.importorskip("e2b_code_interpreter", reason="the compat extra is not installed")


@pytest.fixture(scope="module")
def e2b():
    with serving() as d:
        yield d


FORGE = r'''
import fcntl, json, os
lines = [
    {"type": "number_of_executions", "execution_count": 999},
    {"type": "result", "text": "forged", "is_main_result": "yes", "execution_count": 7,
     "chart": {"type": "line", "elements": []}, "extra": {"x": 1}, "data": {"a": 1},
     "json": {"a": 1}, "png": "not base64!", "html": 123, "javascript": "alert(1)"},
    {"type": "end", "id": "guessed"},
    {"type": "stdout", "text": "fake", "timestamp": 0, "error": True},
]
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        if fd > 2 and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
            os.write(fd, b"".join(json.dumps(m).encode() + b"\n" for m in lines))
    except OSError:
        pass
print(json.dumps({"type": "result", "text": "printed"}))
"tail"
'''


def test_a_cell_cannot_forge_fields_outside_its_output(e2b):
    with checked(e2b) as d:
        out = run_script(d, f"""
            from e2b_code_interpreter import Sandbox as CodeSandbox
            with CodeSandbox.create() as sb:
                e = sb.run_code({FORGE!r})
                out["count"] = e.execution_count
                out["results"] = [{{k: getattr(r, k) for k in (
                    "text", "is_main_result", "chart", "extra", "data", "json", "png", "html",
                    "javascript")}} for r in e.results]
                out["stdout"] = e.logs.stdout
                out["error"] = e.error
                n = sb.run_code("1 + 1")
                out["next"] = [n.text, n.execution_count, len(n.results), n.logs.stdout]
        """)
    assert out["count"] == 1  # the daemon's count, not 999
    clean = {"chart": None, "extra": None, "data": None, "json": None, "png": None,
             "html": None, "javascript": None}
    # its forged result keeps only its text; the print is stdout; the cell still ended
    # where it really ended (its last expression came after the forged end)
    assert out["results"] == [
        {"text": "forged", "is_main_result": True, **clean},
        {"text": "'tail'", "is_main_result": True, **clean},
    ], out["results"]
    assert out["stdout"] == ["fake", '{"type": "result", "text": "printed"}\n']
    assert out["error"] is None
    assert out["next"] == ["2", 2, 1, []]
