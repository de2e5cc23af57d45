"""kill -9 of a busy daemon, again and again: nothing is lost, nothing leaks.

Each round fills a real daemon (``python -m corral.server``) with sandboxes, exec
loops, a snapshot commit, an image build and a filling pool, records every process the
daemon has, and ``kill -9``s it (in turn: while a snapshot's layer is being staged,
while the build's layer is, at a random moment); then it starts a new daemon on the
same state directory and checks that

- no process of the dead daemon runs, and every process in the engine's cgroup
  subtree belongs to the new daemon; no mount is left under its directories; no
  staging directory (a half-committed snapshot or image layer) survives the restart;
- every sandbox the dead daemon had alive is ``failed``, with a reason saying it was
  lost, and none is alive;
- every snapshot that was taken (before this kill or an earlier one) restores byte
  for byte, and so does the interrupted one if its commit finished in time.

At the end, a kill -9 not followed by a restart must leave no process, cgroup or mount
once the dead daemon's warden is done, and a clean SIGINT nothing at all. The restart times are printed
(and written as JSON when ``CORRAL_FAULTS_REPORT`` names a file); nothing here waits
on a wall-clock threshold.

Environment variables (read here): ``CORRAL_FAULTS_KILLS`` (default 3: each kind of
kill moment once) and ``CORRAL_FAULTS_SANDBOXES`` (default 30) size a run; ``make
faults`` runs 10 x 100.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import secrets
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import requires_root
from tests.faults.host import Host, alive, describe, start_time

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(3600)]

KILLS = int(os.environ.get("CORRAL_FAULTS_KILLS", "3"))
SANDBOXES = int(os.environ.get("CORRAL_FAULTS_SANDBOXES", "30"))
REPORT = os.environ.get("CORRAL_FAULTS_REPORT")
LIVE = {"pending", "running", "paused", "stopping"}
DATA = "/home/sandbox/data.bin"
BIG_MB = 64  # the files whose snapshot commit and image layer are in flight at the kill
TAG = "faults"


def _client(host: Host) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(uds=str(host.socket),
                                         limits=httpx.Limits(max_connections=400))
    return httpx.AsyncClient(transport=transport, base_url="http://corral", timeout=300)


async def _ok(reply: httpx.Response, status: int = 200) -> dict:
    assert reply.status_code == status, f"{reply.request.method} {reply.request.url}: {reply.text}"
    return reply.json() if reply.content else {}


async def _create(c: httpx.AsyncClient, **spec) -> str:
    spec.setdefault("memory_mb", 64)
    spec.setdefault("tags", [TAG])
    return (await _ok(await c.post("/v1/sandboxes", json=spec), 201))["id"]


async def _exec(c: httpx.AsyncClient, sid: str, cmd: str) -> dict:
    return await _ok(await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 60}))


async def _list(c: httpx.AsyncClient) -> dict[str, dict]:
    return {s["id"]: s for s in (await _ok(await c.get("/v1/sandboxes")))["sandboxes"]}


@dataclass
class Taken:
    """A snapshot and what its file must hold."""

    name: str
    sha256: str
    path: str = DATA


@dataclass
class Figures:
    restart_s: list[float] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    inflight_snapshot_kept: int = 0
    wrong_results: int = 0
    exec_ok: int = 0
    snapshots_restored: int = 0
    staging_at_kill: int = 0  # staged layers the kills left for the restart to sweep


async def _exec_loop(c: httpx.AsyncClient, sid: str, figures: Figures) -> None:
    """Echo unique tokens until the daemon dies (its errors then end the loop)."""
    for _ in range(100_000):  # bounded; the kill ends it long before
        token = secrets.token_hex(8)
        try:
            reply = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", token]})
        except httpx.HTTPError:
            return
        if reply.status_code != 200:
            return
        if reply.json()["stdout"] != token + "\n":
            figures.wrong_results += 1
        figures.exec_ok += 1


async def _build(c: httpx.AsyncClient, round_no: int) -> None:
    """An image build whose step writes a layer worth staging (unique: never cached)."""
    step = (f"head -c {BIG_MB}M /dev/urandom > /home/sandbox/blob-{round_no}-"
            f"{secrets.token_hex(4)}; sleep 0.2")
    body = {"spec": {"base": "python", "memory_mb": 256, "steps": [{"run": step}]},
            "name": f"faults-{round_no}"}
    try:
        async with c.stream("POST", "/v1/images/build", json=body) as r:
            async for _ in r.aiter_lines():
                pass
    except httpx.HTTPError:
        pass


async def _restores(c: httpx.AsyncClient, snap: Taken) -> None:
    """A sandbox from the snapshot holds the same bytes."""
    sid = await _create(c, snapshot=snap.name, memory_mb=256)
    try:
        out = await _exec(c, sid, f"sha256sum {snap.path}")
        assert out["returncode"] == 0, out
        assert out["stdout"].split()[0] == snap.sha256, f"snapshot {snap.name} changed"
    finally:
        await c.delete(f"/v1/sandboxes/{sid}")


async def _kill_moment(host: Host, round_no: int, rng: random.Random) -> None:
    """Wait for the moment to kill: in turn, while a snapshot's layer is being staged,
    while the image build's layer is, and at a random moment."""
    kind = round_no % 3
    if kind == 2:
        await asyncio.sleep(rng.uniform(0.05, 1.5))
        return
    where = host.layout.layers_dir if kind == 0 else host.layout.images_dir / ".layers"
    deadline = time.monotonic() + 60  # only against a hang: kill anyway then
    while time.monotonic() < deadline:
        if any(n.startswith(".tmp-") for n in _names(where)):
            return
        await asyncio.sleep(0.002)


def _names(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


async def _round(host: Host, round_no: int, taken: list[Taken], figures: Figures,
                 rng: random.Random) -> tuple[set[str], dict[int, int], set[str], Taken]:
    """Fill the daemon, start work in flight, kill -9 it mid-way. Returns the sandboxes
    alive just before the kill, the daemon's processes and cgroups then, and the in-flight
    snapshot."""
    async with _client(host) as c:
        sids = await asyncio.gather(*(_create(c) for _ in range(SANDBOXES)))
        # A snapshot taken to completion before the kill.
        data = os.urandom(rng.randrange(1, 512 << 10))
        await _ok(await c.put(f"/v1/sandboxes/{sids[0]}/files", params={"path": DATA},
                              content=data), 204)
        name = f"done-{round_no}"
        await _ok(await c.post(f"/v1/sandboxes/{sids[0]}/snapshot", json={"name": name}), 201)
        taken.append(Taken(name, hashlib.sha256(data).hexdigest()))
        # One that is being committed at the kill (or just done, or not yet begun).
        big = await _create(c, memory_mb=256)
        made = await _exec(c, big, f"head -c {BIG_MB}M /dev/urandom > {DATA}; sha256sum {DATA}")
        inflight = Taken(f"inflight-{round_no}", made["stdout"].split()[0])
        work = [asyncio.create_task(_exec_loop(c, sid, figures)) for sid in sids]
        work.append(asyncio.create_task(
            c.post(f"/v1/sandboxes/{big}/snapshot", json={"name": inflight.name})))
        work.append(asyncio.create_task(_build(c, round_no)))
        work.append(asyncio.create_task(c.post("/v1/pools", json={
            "name": f"faults-{round_no}", "spec": {"memory_mb": 64, "tags": [TAG]},
            "min_ready": SANDBOXES // 3, "max_size": SANDBOXES // 2})))
        live = {s for s, info in (await _list(c)).items() if info["state"] in LIVE}
        processes = host.tree()  # the warden and launchers; sandboxes are found below
        await _kill_moment(host, round_no, rng)
        host.kill9()
        # Orphaned now, but still in the engine's cgroups (unless the warden was quick).
        processes.update({p: start_time(p) for p in host.in_cgroups()})
        groups = set(host.cgroup_children())
        figures.staging_at_kill += len(host.staging())
        await asyncio.gather(*work, return_exceptions=True)
    return live, processes, groups, inflight


async def _after_restart(host: Host, live: set[str], processes: dict[int, int],
                         groups: set[str], inflight: Taken, taken: list[Taken],
                         figures: Figures) -> None:
    left = [p for p, start in processes.items() if alive(p, start)]
    assert not left, f"processes of the killed daemon still run: {left}"
    kept = groups & set(host.cgroup_children())  # names are random: new ones differ
    assert not kept, f"cgroups of the killed daemon are left: {kept}"
    grouped = host.in_cgroups()  # first: a process started after it is not in it
    ours = host.tree()
    strays = {p: describe(p) for p in grouped if p not in ours and alive(p)}
    assert not strays, f"processes in the engine's cgroups not of the new daemon: {strays}"
    assert not host.host_mounts(), host.host_mounts()
    assert not host.staging(), f"staging survived the restart: {host.staging()}"
    assert host.sandbox_dirs() == [], "sandbox directories of dead sandboxes"
    async with _client(host) as c:
        now = await _list(c)
        assert not [s for s, i in now.items() if i["state"] in LIVE], "alive after a restart?"
        for sid in live:
            info = now.get(sid)
            assert info is not None, f"{sid} vanished from the registry"
            assert info["state"] == "failed" and "lost" in (info["reason"] or ""), info
        figures.lost.append(len(live))
        for snap in taken:
            await _restores(c, snap)
            figures.snapshots_restored += 1
        kept = await c.get(f"/v1/snapshots/{inflight.name}")
        if kept.status_code == 200:  # the commit finished before the kill
            figures.inflight_snapshot_kept += 1
            taken.append(inflight)
            await _restores(c, inflight)
        else:
            assert kept.status_code == 404, kept.text


async def _killed_and_not_restarted(host: Host) -> None:
    """kill -9 with sandboxes running and paused, and no new daemon: once the dead one's
    warden is done, no process, cgroup (its own included) or mount of it is left."""
    async with _client(host) as c:
        sids = await asyncio.gather(*(_create(c) for _ in range(4)))
        await _ok(await c.post(f"/v1/sandboxes/{sids[0]}/pause"))
    old = host.tree()
    host.kill9()
    deadline = time.monotonic() + 60  # only against a hang
    while any(alive(p, start) for p, start in old.items()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not [p for p, start in old.items() if alive(p, start)]
    assert host.in_cgroups() == {} and not host.cgroup_exists() and not host.host_mounts()
    # Their records and directories stay for the next start to reconcile.


def _assert_nothing_left(host: Host) -> None:
    assert host.in_cgroups() == {}, "processes in the engine's cgroups after a clean stop"
    assert host.cgroup_children() == [] and not host.cgroup_exists()
    assert not host.host_mounts() and not host.staging() and host.sandbox_dirs() == []


async def test_kill9_loses_nothing_and_leaks_nothing():
    # Without live restore (docs/restart.md): every kill is a crash nobody takes over.
    host = Host.make("--restore-grace", "0")
    figures = Figures()
    rng = random.Random(12)  # the kill moments are the same in every run
    taken: list[Taken] = []
    try:
        figures.restart_s.append(host.start())  # the first start (nothing to reconcile)
        for round_no in range(KILLS):
            live, processes, groups, inflight = await _round(host, round_no, taken, figures,
                                                             rng)
            figures.restart_s.append(host.start())
            await _after_restart(host, live, processes, groups, inflight, taken, figures)
        assert figures.wrong_results == 0, "an exec returned another command's output"
        await _killed_and_not_restarted(host)
        host.start()
        old = host.tree()
        assert host.stop() == 0, f"the daemon did not stop cleanly: see {host.log_file}"
        assert not [p for p, start in old.items() if alive(p, start)]
        _assert_nothing_left(host)
        log = host.log_file.read_text(errors="replace")
        assert "Traceback" not in log, f"the daemon logged a traceback: see {host.log_file}"
    finally:
        host.remove()
    _report(figures)


def _report(figures: Figures) -> None:
    restarts = figures.restart_s[1:]
    summary = {
        "kills": KILLS, "sandboxes": SANDBOXES,
        "first_start_s": round(figures.restart_s[0], 3),
        "restart_s": [round(t, 3) for t in restarts],
        "restart_median_s": round(statistics.median(restarts), 3) if restarts else None,
        "restart_max_s": round(max(restarts), 3) if restarts else None,
        "lost_per_kill": figures.lost,
        "inflight_snapshots_kept": figures.inflight_snapshot_kept,
        "staging_left_by_kills": figures.staging_at_kill,
        "snapshot_restores_checked": figures.snapshots_restored,
        "execs_ok": figures.exec_ok, "wrong_results": figures.wrong_results,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print("\nkill -9 faults:", json.dumps(summary))
    if REPORT:
        Path(REPORT).write_text(json.dumps(summary, indent=2) + "\n")

