"""A Code Interpreter cell writes to the kernel's protocol channel itself (it runs in
the kernel's process, so it can): it may shape its own output (its results' formats,
as its ``_repr_*_`` methods could), but every format is checked (type, base64, JSON
without NaN, sizes, e2b's chart field by field, so the client's parser never fails),
one execution's results are bounded, and it never sets the execution count or the end
of its execution. Checked with the real client."""

from __future__ import annotations

import pytest

from corral.server.compat import e2b_results
from tests.server.test_compat_e2b import checked, run_script, serving

pytest.importorskip("e2b_code_interpreter", reason="the compat extra is not installed")


@pytest.fixture(scope="module")
def e2b():
    with serving() as d:
        yield d


FORGE = r'''
import fcntl, json, os
nan = float("nan")
line = {"type": "line", "title": "t", "x_label": None, "y_label": None, "x_unit": None,
        "y_unit": None, "x_scale": "linear", "y_scale": "linear", "x_ticks": [0],
        "x_tick_labels": ["0"], "y_ticks": [], "y_tick_labels": [],
        "elements": [{"label": "l", "points": [[0, 1]]}]}
bad_points = dict(line, elements=[{"label": "l", "points": [{"x": 0}]}])
nested = {"type": "superchart", "title": None, "elements": [
    {"type": "superchart", "title": None, "elements": []}]}
lines = [
    {"type": "number_of_executions", "execution_count": 999},
    {"type": "result", "text": "forged", "is_main_result": "yes", "execution_count": 7,
     "chart": {"type": "line", "elements": []}, "extra": {"x": 1}, "data": {"a": 1},
     "json": {"a": 1}, "png": "not base64!", "html": 123, "javascript": "alert(1)",
     "svg": "s" * (2 << 20), "jpeg": "QUJD", "latex": ["x"]},
    {"type": "result", "text": "charts", "chart": dict(line, evil="x", title=7)},
    {"type": "result", "text": "points", "chart": bad_points},
    {"type": "result", "text": "nested", "chart": nested},
    {"type": "result", "text": "nan", "chart": dict(line, x_ticks=[nan]),
     "json": {"v": nan}, "extra": {"k": [nan]}},
    {"type": "result", "text": "kept", "chart": dict(line, evil="x")},
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

FLOOD = r'''
import fcntl, json, os
many = b"".join(json.dumps({"type": "result", "text": str(i), "is_main_result": False,
                            "json": {"i": i}}).encode() + b"\n" for i in range(N))
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        if fd > 2 and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
            os.write(fd, many)
    except OSError:
        pass
'''


def test_a_cell_cannot_forge_fields_outside_its_output(e2b):
    with checked(e2b) as d:
        out = run_script(d, f'''
            import logging
            from e2b_code_interpreter import Sandbox as CodeSandbox
            failed = []
            class Catch(logging.Handler):
                def emit(self, record):
                    failed.append(record.getMessage())
            logging.getLogger("e2b_code_interpreter").addHandler(Catch())
            with CodeSandbox.create() as sb:
                e = sb.run_code({FORGE!r})
                out["count"] = e.execution_count
                out["results"] = [{{k: getattr(r, k) for k in (
                    "text", "is_main_result", "extra", "data", "json", "png", "html",
                    "javascript", "svg", "jpeg", "latex") if getattr(r, k) is not None}}
                    for r in e.results]
                out["charts"] = [r.chart and r.chart.to_dict() for r in e.results]
                out["stdout"] = e.logs.stdout
                out["error"] = e.error
                n = sb.run_code("1 + 1")
                out["next"] = [n.text, n.execution_count, len(n.results), n.logs.stdout]
            out["client_errors"] = failed
        ''')
    assert out["count"] == 1  # the daemon's count, not 999
    # its forged results keep only their well-formed formats; the print is stdout; the
    # cell still ended where it really ended (its last expression came after the
    # forged end)
    assert out["results"] == [
        {"text": "forged", "is_main_result": True, "extra": {"x": 1}, "json": {"a": 1},
         "javascript": "alert(1)", "jpeg": "QUJD"},
        {"text": "charts", "is_main_result": True},
        {"text": "points", "is_main_result": True},
        {"text": "nested", "is_main_result": True},
        {"text": "nan", "is_main_result": True},
        {"text": "kept", "is_main_result": True},
        {"text": "'tail'", "is_main_result": True},
    ], out["results"]
    kept = out["charts"][5]
    assert out["charts"][:5] == [None] * 5 and out["charts"][6] is None
    assert kept["type"] == "line" and "evil" not in kept  # rebuilt from known fields
    assert kept["elements"] == [{"label": "l", "points": [[0, 1]]}]
    assert out["client_errors"] == []  # the client's chart parser never failed
    assert out["stdout"] == ["fake", '{"type": "result", "text": "printed"}\n']
    assert out["error"] is None
    assert out["next"] == ["2", 2, 1, []]


def test_one_executions_results_are_bounded(e2b):
    n = e2b_results.MAX_RESULTS + 50
    with checked(e2b) as d:
        out = run_script(d, f'''
            from e2b_code_interpreter import Sandbox as CodeSandbox
            with CodeSandbox.create() as sb:
                e = sb.run_code("N = {n}\\n" + {FLOOD!r})
                out["n"] = len(e.results)
                out["last"] = e.results[-1].text
                out["stderr"] = e.logs.stderr
                out["next"] = sb.run_code("2 + 2").text
        ''')
    assert out["n"] == e2b_results.MAX_RESULTS
    assert out["last"] == str(e2b_results.MAX_RESULTS - 1)
    assert len(out["stderr"]) == 1 and "were cut to their text or dropped" in out["stderr"][0]
    assert out["next"] == "4"


def test_the_byte_budget_keeps_only_text_past_it():
    budget = e2b_results.Budget()
    big = {"type": "result", "text": "t", "png": "QUJD", "is_main_result": False}
    size = e2b_results.MAX_RESULT_BYTES // 2
    assert budget.admit(dict(big), size) == big
    assert budget.admit(dict(big), size) == big
    assert budget.note() is None
    assert budget.admit(dict(big), size) == {"type": "result", "text": "t",
                                             "is_main_result": False}
    assert budget.note() is not None and budget.note() is None  # said once


POINT = {"type": "line", "title": "t", "x_label": "x", "y_label": None, "x_unit": None,
         "y_unit": None, "x_scale": "log", "y_scale": "linear", "x_ticks": [0, "a"],
         "x_tick_labels": ["0", "a"], "y_ticks": [1.5], "y_tick_labels": ["1.5"],
         "elements": [{"label": "l", "points": [[0, 1], ["a", 2.5]]}]}
VALID = [
    POINT, dict(POINT, type="scatter"),
    {"type": "bar", "title": None, "x_label": None, "y_label": "n", "x_unit": None,
     "y_unit": None, "elements": [{"label": "a", "group": "g", "value": 3}]},
    {"type": "pie", "title": "p", "elements": [{"label": "x", "angle": 90, "radius": 1}]},
    {"type": "box_and_whisker", "title": None, "x_label": None, "y_label": None,
     "x_unit": None, "y_unit": None, "elements": [
         {"label": "b", "min": 0, "first_quartile": 1, "median": 2, "third_quartile": 3,
          "max": 4, "outliers": [9]}]},
    {"type": "unknown", "title": "u", "elements": []},
]
VALID.append({"type": "superchart", "title": "s", "elements": VALID[:5]})


def _mutations(value, path=()):
    """Each way of breaking ``value`` at one place: a field removed, or set to a value
    of another type."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield {k: v for k, v in value.items() if k != key}
            for bad in (None, 7, "s", [], {}, float("nan"), True):
                yield {**value, key: bad}
            for sub in _mutations(item):
                yield {**value, key: sub}
    elif isinstance(value, list):
        for i, item in enumerate(value):
            for sub in _mutations(item):
                yield value[:i] + [sub] + value[i + 1:]


def test_every_chart_the_daemon_passes_on_is_one_the_client_parses():
    """The client's chart parser raises (and logs an error) on any missing field:
    whatever a cell writes, the daemon passes on a chart the client parses or none."""
    from e2b_code_interpreter.charts import _deserialize_chart

    for good in VALID:
        assert e2b_results.chart(good) == good, good["type"]
        assert _deserialize_chart(good) is not None
    checked_count = 0
    for good in VALID:
        for bad in _mutations(good):
            clean = e2b_results.chart(bad)
            if clean is not None:
                _deserialize_chart(clean)  # does not raise
                assert "NaN" not in repr(clean) and "nan" not in repr(clean).lower()
            checked_count += 1
    assert checked_count > 1000
