"""Tenants through the SDK and the CLI, and the state directory's modes: root's alone."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time

import pytest

import corral
from corral.cli.main import main
from tests.security.tenants_helpers import ADMIN_TOKEN, TOKEN_RE, no_traceback, team_daemon


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


@pytest.fixture
def clients(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as a, \
            corral.Client(team.url, token=team.tokens["bob"]) as b:
        yield a, b
    team.cleanup()
    no_traceback(team)


def test_sdk_another_tenants_sandbox_raises_not_found(clients):
    a, b = clients
    sb = corral.Sandbox.create(memory_mb=64, client=a)
    sb.files.write("/workspace/secret", b"alice's")
    snap = sb.snapshot(name="sdk-snap")
    assert sb.info.tenant == "alice"
    assert [s.id for s in corral.Sandbox.list(client=b)] == []
    assert [s.id for s in corral.Snapshot.list(client=b)] == []
    with pytest.raises(corral.SandboxNotFound):
        corral.Sandbox.connect(sb.id, client=b)
    stolen = corral.Sandbox(sb.info, client=b)  # a handle built from a leaked id
    for attack in (lambda: stolen.exec(["true"]), lambda: stolen.files.read("/workspace/secret"),
                   lambda: stolen.files.write("/workspace/secret", b"bob"),
                   lambda: stolen.snapshot(), lambda: stolen.fork(1), lambda: stolen.stop(),
                   lambda: stolen.spawn(["sleep", "5"])):
        with pytest.raises(corral.SandboxNotFound):
            attack()
    stolen.delete()  # idempotent: as for an id that does not exist; nothing happens
    with pytest.raises(corral.SnapshotNotFound):
        corral.Snapshot.get(snap.id, client=b)
    with pytest.raises(corral.SnapshotNotFound):
        corral.Sandbox.create(snapshot="sdk-snap", client=b)
    assert sb.files.read("/workspace/secret") == b"alice's"
    assert sb.exec(["true"]).returncode == 0


def test_sdk_another_tenant_cannot_consume_a_process(clients):
    """``consume`` deletes the sandbox: with a leaked sandbox and process id, another
    tenant neither reads the line, nor ends the process, nor deletes the sandbox."""
    a, b = clients
    sb = corral.Sandbox.create(memory_mb=64, client=a)
    proc = sb.spawn(["python3", "-c", "import sys\nfor l in sys.stdin: print(l.upper(), end='', flush=True)"])
    stolen = corral.Process(proc._info, client=b, args=proc.args)
    with pytest.raises(corral.SandboxNotFound):
        stolen.consume("bob\n", timeout=5)
    assert proc.exchange("alice\n", timeout=30) == "ALICE\n"  # nothing of bob's was read
    assert sb.refresh().state.value == "running"
    line, ended = proc.consume("last\n", timeout=30, exit_timeout=0.5)
    assert line == "LAST\n" and ended.returncode == -9  # still reading: killed at the end
    with pytest.raises(corral.SandboxNotFound):
        corral.Sandbox.connect(sb.id, client=a)


def test_sdk_another_tenant_cannot_fork_live_or_reach_a_forks_processes(clients):
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    a, b = clients
    sb = corral.Sandbox.create(checkpointable=True, network="none", client=a)
    proc = sb.spawn(["cat"])
    stolen = corral.Sandbox(sb.info, client=b)
    for attack in (lambda: stolen.fork(1, live=True), lambda: stolen.checkpoint(),
                   lambda: stolen.process(proc.id), lambda: stolen.hibernate()):
        with pytest.raises(corral.SandboxNotFound):
            attack()
    (copy,) = sb.fork(1, live=True)
    snap = sb.checkpoint(name="alice-live")
    with pytest.raises(corral.SandboxNotFound):
        corral.Sandbox(copy.info, client=b).process(proc.id)
    with pytest.raises(corral.SnapshotNotFound):
        corral.Sandbox.create(snapshot=snap.id, client=b)
    assert corral.Sandbox.list(client=b) == []
    mine = copy.process(proc.id)  # alice's copy of her process, reattached
    mine.write("hi\n")
    assert mine.readline() == "hi\n"


def test_sdk_quota_is_a_typed_error(team, clients):
    token = team.make_token("sdkquota", max_sandboxes=1)
    with corral.Client(team.url, token=token) as c:
        first = corral.Sandbox.create(memory_mb=64, client=c)
        with pytest.raises(corral.QuotaExceeded) as caught:
            corral.Sandbox.create(memory_mb=64, client=c, wait=0)  # refused at once
        assert isinstance(caught.value, corral.CapacityExceeded)
        assert caught.value.details["quota"] == "max_sandboxes"
        assert "max_sandboxes" in str(caught.value)
        first.delete()


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_token_create_ls_revoke(team, capsys):
    admin = ("--url", team.daemon.url)
    code, out, _ = _cli(capsys, *admin, "token", "create", "cli-team", "--max-sandboxes", "3",
                        "--max-memory-mb", "512", "--max-cpus", "2", "--json")
    assert code == 0
    made = json.loads(out)
    assert made.keys() == {"name", "token"} and made["name"] == "cli-team"
    assert TOKEN_RE.fullmatch(made["token"])
    code, out, _ = _cli(capsys, *admin, "token", "create", "cli-plain")
    assert code == 0 and TOKEN_RE.fullmatch(out.strip())
    code, out, _ = _cli(capsys, *admin, "token", "ls", "--json")
    listed = {t["name"]: t for t in json.loads(out)}
    assert listed["cli-team"]["max_sandboxes"] == 3 and listed["cli-team"]["max_cpus"] == 2
    assert made["token"] not in out
    code, out, _ = _cli(capsys, *admin, "token", "ls")
    assert code == 0 and "cli-team" in out and made["token"] not in out
    # a tenant token cannot make tokens, even on TCP
    tenant = ("--url", team.url, "--token", made["token"])
    code, _, err = _cli(capsys, *tenant, "token", "create", "sneaky")
    assert code == 1 and "admin" in err
    code, out, _ = _cli(capsys, *tenant, "create", "--memory-mb", "64")
    assert code == 0
    sid = out.strip().split()[-1]
    code, out, _ = _cli(capsys, "--url", team.url, "--token", team.tokens["bob"], "ls", "--json")
    assert sid not in out
    code, _, err = _cli(capsys, "--url", team.url, "--token", team.tokens["bob"],
                        "exec", sid, "--", "true")
    assert code == 1 and "no sandbox" in err
    code, _, err = _cli(capsys, "--url", team.url, "--token", team.tokens["bob"], "stop", sid)
    assert code == 1 and "no sandbox" in err
    code, out, _ = _cli(capsys, "--url", team.url, "--token", ADMIN_TOKEN, "ls", "--json")
    assert sid in out
    code, out, _ = _cli(capsys, *admin, "token", "revoke", "cli-team", "cli-plain")
    assert code == 0 and out.split() == ["cli-team", "cli-plain"]
    code, _, err = _cli(capsys, *tenant, "ls")
    assert code == 1 and "token" in err
    team.cleanup()


# -------------------------------------------------------------- state files


def _modes(root) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode)
            for p in [root, *root.iterdir()]}


def test_state_files_are_root_only_and_fixed_at_start(team):
    state = team.daemon.state_dir
    modes = _modes(state)
    for name, mode in modes.items():
        path = state / name
        if path.is_dir():
            # the state dir and sandboxes/ are traversable (bwrap, as a sandbox's uid,
            # reaches its root by path), never listable; the rest is root's alone
            expected = 0o711 if name in (".", "sandboxes") else 0o700
        else:
            expected = 0o600
        assert mode == expected, (name, oct(mode))
    assert {"registry.db", "layers"} <= set(modes)


def test_modes_left_open_are_fixed_at_start(make_daemon):
    d = make_daemon()
    d.stop()
    for name in ("registry.db", "engine.lock"):
        os.chmod(d.state_dir / name, 0o644)
    os.chmod(d.state_dir / "layers", 0o755)
    (d.state_dir / "stray.log").write_text("secret")
    os.chmod(d.state_dir / "stray.log", 0o644)
    d.start()
    with corral.Client(d.url) as c:  # sandboxes still start and run after the change
        with corral.Sandbox.create(memory_mb=64, client=c) as sb:
            assert sb.exec(["true"]).returncode == 0
            snap = sb.snapshot()
        with corral.Sandbox.create(snapshot=snap.id, memory_mb=64, client=c) as copy:
            assert copy.exec(["ls", "/workspace"]).returncode == 0
        snap.delete()
    for name in ("registry.db", "engine.lock", "stray.log"):
        assert stat.S_IMODE((d.state_dir / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((d.state_dir / "layers").stat().st_mode) == 0o700


def test_a_local_user_cannot_read_the_registry(team):
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux)")
    nobody = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
    for name in ("registry.db", "registry.db-wal"):
        path = team.daemon.state_dir / name
        if path.exists():
            r = subprocess.run([*nobody, "cat", str(path)], capture_output=True, timeout=30)
            assert r.returncode != 0 and b"Permission denied" in r.stderr, r
    r = subprocess.run([*nobody, "ls", str(team.daemon.state_dir)], capture_output=True,
                       timeout=30)
    assert r.returncode != 0, r  # not even listable
    r = subprocess.run([*nobody, "ls", str(team.daemon.state_dir / "layers")],
                       capture_output=True, timeout=30)
    assert r.returncode != 0, r


def test_a_consume_that_replies_first_keeps_its_place_until_its_sandbox_is_gone(team):
    """``consume(delete_first=False)`` (how the code rewards use a pre-started judge)
    replies before its sandbox's deletion ends: the tenant's place is still taken until
    then, so a create right after the reply never runs beside the consumed sandbox, with
    a quota of one sandbox."""
    team.make_token("quinn", max_sandboxes=1)
    with corral.Client(team.url, token=team.tokens["quinn"]) as q:
        sb = corral.Sandbox.create(memory_mb=64, client=q)
        proc = sb.spawn(["python3", "-c", "print(input().upper())"])
        line, ended = proc.consume("x\n", timeout=30, delete_first=False)
        assert line == "X\n" and ended.returncode == 0
        for _ in range(600):
            try:
                new = corral.Sandbox.create(memory_mb=64, client=q)
            except corral.CapacityExceeded:  # QuotaExceeded too
                time.sleep(0.05)  # the consumed one still holds the place: as it should
                continue
            running = [s.id for s in corral.Sandbox.list(client=q)]
            assert running == [new.id], f"two sandboxes under a quota of one: {running}"
            new.delete()
            break
        else:
            pytest.fail("the consumed sandbox never gave its place back")
    team.cleanup()
    no_traceback(team)
