"""E2B's Code Interpreter result formats (every ``_repr_*_``, ``_repr_mimebundle_``'s
others as ``extra``, ``display``, matplotlib's ``chart``) and ``watch_dir``'s
``include_entry``, with the real ``e2b`` / ``e2b-code-interpreter`` clients."""

from __future__ import annotations

import pytest

from tests.server.test_compat_e2b import checked, run_script, serving

pytest.importorskip("e2b_code_interpreter", reason="the compat extra is not installed")


@pytest.fixture(scope="module")
def e2b():
    with serving() as d:
        yield d


REPRS = r'''
class Rich:
    def __repr__(self): return "Rich()"
    def _repr_html_(self): return "<b>h</b>"
    def _repr_markdown_(self): return "**m**"
    def _repr_svg_(self): return "<svg xmlns='http://www.w3.org/2000/svg'/>"
    def _repr_png_(self): return b"\x89PNG\r\n\x1a\n"
    def _repr_jpeg_(self): return (b"\xff\xd8\xff", {"width": 1})
    def _repr_pdf_(self): return b"%PDF-1.4"
    def _repr_latex_(self): return r"$\alpha^2$"
    def _repr_json_(self): return {"a": [1, 2.5, None, "x"]}
    def _repr_javascript_(self): return "console.log(1)"
class Bundle:
    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": "B", "text/latex": "$b$",
                "application/vnd.custom+json": {"k": [1, 2]}, "text/x-note": "n"}
class Broken:
    def _repr_html_(self): raise RuntimeError("no html")
    def _repr_json_(self): return {"nan": float("nan")}
    def _repr_svg_(self): return 42
display(Bundle(), Broken())
Rich()
'''

FORMATS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json",
           "javascript", "chart", "extra", "is_main_result")


def test_every_repr_format_reaches_the_client(e2b):
    with checked(e2b) as d:
        out = run_script(d, f"""
            import base64
            from e2b_code_interpreter import Sandbox as CodeSandbox
            with CodeSandbox.create() as sb:
                e = sb.run_code({REPRS!r})
                out["error"] = e.error and [e.error.name, e.error.value]
                out["results"] = [{{k: getattr(r, k) for k in {FORMATS!r}
                                   if getattr(r, k) is not None}} for r in e.results]
                out["formats"] = [sorted(r.formats()) for r in e.results]
                main = e.results[-1]
                out["bytes"] = [base64.b64decode(main.png).hex(),
                                base64.b64decode(main.jpeg).hex(),
                                base64.b64decode(main.pdf).decode()]
                out["text"] = e.text
        """)
    assert out["error"] is None
    bundle, broken, rich = out["results"]
    assert bundle == {"text": "B", "latex": "$b$", "is_main_result": False,
                      "extra": {"application/vnd.custom+json": {"k": [1, 2]},
                                "text/x-note": "n"}}
    # a display method that fails, returns NaN JSON or a non-string: that format only
    # is left out
    assert broken["is_main_result"] is False and set(broken) == {"text", "is_main_result"}
    assert rich["is_main_result"] is True and rich["text"] == "Rich()"
    assert {k: rich[k] for k in ("html", "markdown", "svg", "latex", "json", "javascript")} == {
        "html": "<b>h</b>", "markdown": "**m**",
        "svg": "<svg xmlns='http://www.w3.org/2000/svg'/>", "latex": r"$\alpha^2$",
        "json": {"a": [1, 2.5, None, "x"]}, "javascript": "console.log(1)"}
    assert out["bytes"] == ["89504e470d0a1a0a", "ffd8ff", "%PDF-1.4"]
    assert out["formats"][2] == sorted(["text", "html", "markdown", "svg", "png", "jpeg",
                                        "pdf", "latex", "json", "javascript"])
    assert out["text"] == "Rich()"


CHARTS = r'''
import datetime
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.plot([1, 2, 3], [1, 4, 9], label="squares")
ax.plot([1, 2, 3], [1, 2, 3], label="linear")
ax.set_title("growth"); ax.set_xlabel("time (s)"); ax.set_ylabel("size [m]")
fig, ax = plt.subplots()
ax.scatter([1, 2], [3, 4], label="dots")
ax.set_title("scatter")
fig, ax = plt.subplots()
ax.bar(["a", "b", "c"], [3, 1, 2], label="counts")
ax.set_title("bars"); ax.set_ylabel("n")
fig, ax = plt.subplots()
ax.pie([1, 3], labels=["x", "y"])
fig, axes = plt.subplots(1, 2)
fig.suptitle("both")
axes[0].plot([0, 1], [1, 0]); axes[1].barh(["p"], [5])
fig, ax = plt.subplots()
ax.plot([datetime.date(2024, 1, d) for d in (1, 2)], [1, 2])
fig, ax = plt.subplots()
ax.imshow([[1, 2], [3, 4]]); ax.set_title("image")
None
'''


def test_matplotlib_figures_come_with_e2b_charts(e2b):
    with checked(e2b) as d:
        out = run_script(d, f"""
            from e2b_code_interpreter import Sandbox as CodeSandbox
            from e2b_code_interpreter.charts import (
                BarChart, LineChart, PieChart, ScatterChart, SuperChart)
            with CodeSandbox.create() as sb:
                e = sb.run_code({CHARTS!r})
                out["error"] = e.error and [e.error.name, e.error.value]
                cs = [r.chart for r in e.results]
                out["png"] = all(r.png for r in e.results)
                line, scatter, bar, pie, sup, dates, image = cs
                out["line"] = [type(line).__name__, line.type.value, line.title,
                               line.x_label, line.x_unit, line.y_label, line.y_unit,
                               line.x_scale.value,
                               [(p.label, p.points) for p in line.elements],
                               len(line.x_ticks) == len(line.x_tick_labels) > 0]
                out["scatter"] = [type(scatter).__name__, scatter.title,
                                  [(p.label, p.points) for p in scatter.elements]]
                out["bar"] = [type(bar).__name__, bar.title, bar.y_label,
                              [(b.label, b.group, b.value) for b in bar.elements]]
                out["pie"] = [type(pie).__name__,
                              [(p.label, p.angle, p.radius) for p in pie.elements]]
                out["super"] = [type(sup).__name__, sup.title,
                                [type(c).__name__ for c in sup.elements],
                                [(b.label, b.value) for b in sup.elements[1].elements]]
                out["dates"] = [dates.x_scale.value, dates.elements[0].points]
                out["image"] = [image.type.value, image.title, image.elements]
                out["dict"] = line.to_dict()["type"]
        """)
    assert out["error"] is None and out["png"] is True
    assert out["line"] == ["LineChart", "line", "growth", "time (s)", "s", "size [m]", "m",
                           "linear", [["squares", [[1.0, 1.0], [2.0, 4.0], [3.0, 9.0]]],
                                      ["linear", [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]]],
                           True]
    assert out["scatter"] == ["ScatterChart", "scatter", [["dots", [[1.0, 3.0], [2.0, 4.0]]]]]
    assert out["bar"] == ["BarChart", "bars", "n",
                          [["a", "counts", 3.0], ["b", "counts", 1.0], ["c", "counts", 2.0]]]
    assert out["pie"] == ["PieChart", [["x", 90.0, 1], ["y", 270.0, 1]]]
    assert out["super"] == ["SuperChart", "both", ["LineChart", "BarChart"], [["p", 5.0]]]
    assert out["dates"] == ["datetime", [["2024-01-01", 1.0], ["2024-01-02", 2.0]]]
    assert out["image"] == ["unknown", "image", []]
    assert out["dict"] == "line"


def test_watch_dir_with_entries(e2b):
    with checked(e2b) as d:
        out = run_script(d, """
            import time
            with Sandbox.create() as sb:
                f = sb.files
                f.make_dir("/tmp/w")
                h = f.watch_dir("/tmp/w", include_entry=True, recursive=True)
                plain = f.watch_dir("/tmp/w")
                events = []
                def until(name, kind):
                    for _ in range(100):  # bounded: 20 s at most
                        events.extend(h.get_new_events())
                        for e in events:
                            if (e.name, e.type.value) == (name, kind):
                                return e.entry
                        time.sleep(0.2)
                    raise AssertionError(f"no {kind} event for {name}")
                sb.commands.run("cd /tmp/w && printf abc > a.txt && mkdir sub && "
                                "ln -s /etc/passwd link")
                a = until("a.txt", "create")
                out["file"] = [a.name, a.path, a.type.value]
                out["size"] = until("a.txt", "write").size  # stat-ed after printf wrote
                s = until("sub", "create")
                out["dir"] = [s.type.value, s.path, s.permissions.startswith("d")]
                ln = until("link", "create")
                out["link"] = [ln.type.value, ln.symlink_target, ln.size]
                sb.commands.run("chmod 640 /tmp/w/a.txt")
                out["mode"] = oct(until("a.txt", "chmod").mode)
                sb.commands.run("rm /tmp/w/a.txt")
                out["removed"] = until("a.txt", "remove")
                out["plain"] = sorted({e.entry is None for e in plain.get_new_events()})
                h.stop(); plain.stop()
        """)
    assert out["file"] == ["a.txt", "/tmp/w/a.txt", "file"]
    assert out["size"] == 3
    assert out["dir"] == ["dir", "/tmp/w/sub", True]
    assert out["link"] == ["symlink", "/etc/passwd", len("/etc/passwd")]  # the link itself
    assert out["mode"] == "0o640"
    assert out["removed"] is None  # gone: no entry, as envd
    assert out["plain"] == [True]


def test_async_watch_stream_with_entries_and_metadata_refused(e2b):
    with checked(e2b) as d:
        out = run_script(d, """
            import asyncio
            from e2b import AsyncSandbox, InvalidArgumentException
            async def main():
                sb = await AsyncSandbox.create()
                try:
                    await sb.files.make_dir("/tmp/a")
                    got = asyncio.Queue()
                    h = await sb.files.watch_dir("/tmp/a", got.put_nowait, include_entry=True)
                    await sb.files.write("/tmp/a/f.txt", "hello")
                    while True:  # bounded by wait_for
                        e = await asyncio.wait_for(got.get(), 20)
                        if e.name == "f.txt" and e.entry is not None and e.entry.size == 5:
                            out["entry"] = [e.entry.path, e.entry.type.value]
                            break
                    await h.stop()
                    try:
                        await sb.files.write("/tmp/a/m.txt", "x", metadata={"k": "v"})
                    except (SandboxException, InvalidArgumentException) as exc:
                        out["metadata"] = str(exc)[:300]
                    out["written"] = await sb.files.exists("/tmp/a/m.txt")
                finally:
                    await sb.kill()
            asyncio.run(main())
        """)
    assert out["entry"] == ["/tmp/a/f.txt", "file"]
    assert "metadata" in out["metadata"] and "leave out metadata" in out["metadata"]
    assert out["written"] is False  # refused before anything was written
