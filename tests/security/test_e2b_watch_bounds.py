"""``files.watch_dir`` against a hostile sandbox: watchers per sandbox and events per
watcher are bounded, and the watcher's pipe (which the sandbox's own code can write
to) carries nothing the daemon trusts: garbage, huge and deeply nested lines are
dropped, forged events only describe names, and the daemon logs no error."""

from __future__ import annotations

import pytest

from corral.server.compat.e2b_watch import MAX_EVENTS, MAX_WATCHERS
from tests.server.test_compat_e2b import checked, run_script, serving


@pytest.fixture(scope="module")
def e2b():
    with serving() as d:
        yield d


FORGE = r"""
import os, json
bad = [json.dumps({"name": "forged", "type": "create", "entry": {"size": 1}}).encode(),
       json.dumps({"name": 1, "type": "create"}).encode(),
       json.dumps({"name": "n", "type": "explode"}).encode(),
       b"not json", b"[" * 100000, b"x" * 100000]  # past the pipe's buffer: cut, dropped
for pid in os.listdir("/proc"):
    try:
        if b"inotify_init1" in open(f"/proc/{pid}/cmdline", "rb").read():
            fd = os.open(f"/proc/{pid}/fd/1", os.O_WRONLY)
            os.write(fd, b"\n".join(bad) + b"\n")
            os.close(fd)
    except OSError:
        pass
"""


def test_watchers_and_events_are_bounded_and_forgeries_dropped(e2b):
    with checked(e2b) as d:
        out = run_script(d, f"""
            import time
            with Sandbox.create() as sb:
                f = sb.files
                f.make_dir("/tmp/w")
                hs = [f.watch_dir("/tmp/w") for _ in range({MAX_WATCHERS})]
                try:
                    f.watch_dir("/tmp/w")
                except SandboxException as e:
                    out["17th"] = str(e)[:200]
                for h in hs[1:]:
                    h.stop()
                h = hs[0]
                # a flood: far more events than a watcher keeps
                sb.commands.run("cd /tmp/w && for i in $(seq 1 3000); do : > f$i; "
                                "echo x >> f$i; done", timeout=120)
                # forgeries, written to every watcher's stdout pipe from inside
                f.write("/tmp/forge.py", {FORGE!r})
                sb.commands.run("python3 /tmp/forge.py", timeout=60)
                time.sleep(1)
                events = h.get_new_events()
                out["count"] = len(events)
                out["forged"] = [(e.name, e.type.value, e.entry) for e in events
                                 if e.name == "forged"]
                out["names_ok"] = all(isinstance(e.name, str) for e in events)
                h.stop()
        """)
    assert "directory watchers already" in out["17th"]
    assert 0 < out["count"] <= MAX_EVENTS
    assert out["names_ok"] is True
    # a forged event is only a name and a type: no entry, nothing else gets through
    assert out["forged"] == [["forged", "create", None]]  # it did reach the pipe


ENTRY_FORGE = r"""
import os, json
ok = {"path": "/tmp/e/claimed", "size": 5, "mode": 0o100644, "mtime": 1.5}
bad = [dict(ok, path="relative"), dict(ok, size=-1), dict(ok, size=1 << 64),
       dict(ok, mode=1 << 20), dict(ok, mtime=float("nan")), dict(ok, mtime=True),
       dict(ok, target=5, mode=0o120777), dict(ok, path="/x\u0000y"), "entry", [ok]]
lines = [{"name": "forged-ok", "type": "create", "entry": ok}]
lines += [{"name": f"forged-bad{i}", "type": "create", "entry": e} for i, e in enumerate(bad)]
for pid in os.listdir("/proc"):
    try:
        if b"inotify_init1" in open(f"/proc/{pid}/cmdline", "rb").read():
            fd = os.open(f"/proc/{pid}/fd/1", os.O_WRONLY)
            os.write(fd, b"".join(json.dumps(m).encode() + b"\n" for m in lines))
            os.close(fd)
    except OSError:
        pass
"""


def test_entries_are_checked_and_links_never_followed(e2b):
    """``include_entry``: a forged entry with any field out of range is dropped (its
    event stays, entry-less); an entry that is a symlink, even one swapped in for a
    file under the watch and pointing at a path of the host, describes the link
    itself: nothing is followed, and nothing is stat-ed outside the sandbox."""
    host_only = str(e2b.base)  # exists on the host, not in the sandbox
    with checked(e2b) as d:
        out = run_script(d, f"""
            import time
            with Sandbox.create() as sb:
                f = sb.files
                f.make_dir("/tmp/e")
                f.write("/tmp/big", "x" * 100000)
                h = f.watch_dir("/tmp/e", include_entry=True)
                sb.commands.run("cd /tmp/e && for i in $(seq 1 20); do "
                                "echo data > x; ln -sfn /tmp/big x; "
                                "ln -sfn {host_only} y; done")
                f.write("/tmp/forge.py", {ENTRY_FORGE!r})
                sb.commands.run("python3 /tmp/forge.py", timeout=60)
                events = []
                for _ in range(50):  # bounded: 10 s at most
                    events.extend(h.get_new_events())
                    if any(e.name == "forged-bad9" for e in events):
                        break
                    time.sleep(0.2)
                h.stop()
                entries = [(e.name, e.entry) for e in events if e.entry is not None]
                out["links"] = sorted({{(n, x.type.value, x.size, x.symlink_target)
                                       for n, x in entries if x.type.value == "symlink"}})
                out["files"] = sorted({{(n, x.size) for n, x in entries
                                       if x.type.value == "file" and n in ("x", "y")}})
                out["forged"] = {{e.name: e.entry and [e.entry.path, e.entry.size]
                                  for e in events if e.name.startswith("forged")}}
        """)
    assert ["x", "symlink", len("/tmp/big"), "/tmp/big"] in out["links"]
    assert ["y", "symlink", len(host_only), host_only] in out["links"]
    assert all(link[2] == len(link[3]) for link in out["links"])  # the link's own size
    assert all(size == len("data\n") or size == 0 for _, size in out["files"])
    assert out["forged"] == {"forged-ok": ["/tmp/e/claimed", 5],
                             **{f"forged-bad{i}": None for i in range(10)}}
