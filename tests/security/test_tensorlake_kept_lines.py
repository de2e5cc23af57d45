"""Attacks on the Tensorlake front-end's kept process output
(server/compat/tensorlake_process.py): a process printing only newlines (``yes ''``).
Its lines were counted by their text against the 16 MiB a process keeps, so empty ones
cost nothing and were kept without end: one object each in the daemon's memory, ~150
bytes, millions a second, until the daemon ran out. Now each line counts what it holds
beyond its text too, so the cap bounds the memory. The first tests need no daemon: the
table's own process record, fed as its pump feeds it; the last runs one (root)."""

from __future__ import annotations

from corral.server.compat.tensorlake_process import (
    PROCESS_OUTPUT_CAP_BYTES,
    Process,
    StreamLines,
)


def _record() -> Process:
    return Process(pid=100, argv=["yes", ""], discard=frozenset(), engine_proc=None)  # type: ignore[arg-type]


def test_empty_lines_reach_the_cap():
    proc, splitter = _record(), StreamLines()
    for _ in range(300):  # 300 reads of 1,000 newlines each
        for line in splitter.feed(b"\n" * 1000):
            proc.keep("stdout", line)
    assert len(proc.lines) <= PROCESS_OUTPUT_CAP_BYTES // 100, len(proc.lines)


def test_text_lines_still_keep_their_text():
    proc = _record()
    for i in range(1000):
        proc.keep("stdout", f"line {i}")
    assert [line.text for line in proc.lines][-1] == "line 999" and len(proc.lines) == 1000


def test_kept_lines_count_against_the_output_budget():
    """Each process keeps up to 16 MiB, and a sandbox's exited processes are kept: a
    tenant starting process after process made the daemon keep 16 MiB each, outside
    the output budget. Now kept lines take their room from it (none kept once it is
    spent), and dropping the sandbox's records gives it back."""
    from corral.runtime.output_budget import OutputBudget
    from corral.server.compat.tensorlake_process import ProcessTable

    budget = OutputBudget(total=8 << 20, per_tenant=4 << 20)
    table = ProcessTable()
    line = "x" * 1000
    for pid in range(3):  # three processes, each printing 4 MiB
        proc = Process(pid=pid, argv=["cat"], discard=frozenset(), engine_proc=None,  # type: ignore[arg-type]
                       budget=budget, tenant="mallory")
        table._by_sandbox.setdefault("sb-1", {})[pid] = proc
        for _ in range(4000):
            proc.keep("stdout", line)
    kept = sum(p.kept_bytes for p in table.list("sb-1"))
    assert budget.by_tenant["mallory"] == kept <= 4 << 20
    assert budget.free_for("bob") == (4 << 20)  # another tenant's share is whole
    table.drop("sb-1")
    assert budget.used == 0 and not budget.by_tenant


def test_a_sandbox_deleted_outside_tensorlake_gives_its_processes_room_back():
    """A process's kept lines hold room in the output budget until its sandbox's records
    are dropped. Only Tensorlake's own delete (and a later ``start_process``'s pruning)
    dropped them: a sandbox that ended otherwise (a native delete, its lifetime, a
    revoke) kept its lines and their room in the daemon (924 bytes seen by
    test_door_revocation after an admin's cleanup). Now any end drops them."""
    import time

    import httpx
    import pytest

    from tests.server.test_compat_tensorlake import run_script, serving

    pytest.importorskip("tensorlake.sandbox")

    def held(c: httpx.Client) -> float:
        return next(float(ln.split()[1]) for ln in c.get("/metrics").text.splitlines()
                    if ln.startswith("corral_output_held_bytes "))

    with serving() as d:
        out = run_script(d, """
            sb = Sandbox.create(memory_mb=64, timeout_secs=600)
            p = sb.start_process("sh", ["-c", "seq 1 2000; sleep 600"])
            for _ in range(600):
                if len(sb.get_stdout(p.pid).lines) == 2000:
                    break
                time.sleep(0.1)
            out["sid"] = sb.sandbox_id
        """)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)),
                          base_url="http://corral", timeout=60) as c:
            assert held(c) > 0  # the 2000 lines kept are held
            assert c.delete(f"/v1/sandboxes/{out['sid']}").status_code in (200, 204)
            deadline = time.monotonic() + 120  # (bounded only against a hang)
            while held(c) != 0:
                assert time.monotonic() < deadline, f"{held(c)} bytes still held"
                time.sleep(0.1)
