"""create, ls, info, pause/resume/stop, rm and errors, on a real daemon."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import corral
from tests.conftest import _base_dir, _wait_for_socket, requires_root

pytestmark = requires_root


def _states(cli, tag: str) -> dict[str, str]:
    return {d["id"]: d["state"] for d in cli("ls", "--tag", tag, "--json").json()}


def test_create_prints_ids_and_ls_shows_them(cli, tag, client):
    r = cli("create", "--memory-mb", "64", "--tag", tag, "--tag", "extra", "-n", "3")
    assert r.code == 0, r.err
    ids = r.out.split()
    assert len(ids) == 3 and all(i.startswith("sb-") for i in ids)

    table = cli("ls", "--tag", tag)
    assert table.code == 0
    rows = [line for line in table.out.splitlines() if line.startswith("sb-")]
    assert sorted(row.split()[0] for row in rows) == sorted(ids)
    for row in rows:
        cells = row.split()
        assert cells[1:3] == ["running", "python"]
        assert f"{tag},extra" in row
        float(cells[-2]), float(cells[-1])  # cpu seconds and memory MB were fetched

    listed = cli("ls", "--tag", tag, "--json").json()
    assert sorted(d["id"] for d in listed) == sorted(ids)
    assert all(d["usage"]["memory_mb"] >= 0 and d["spec"]["memory_mb"] == 64 for d in listed)
    assert cli("ls", "--tag", tag, "-q").out.split() == [d["id"] for d in listed]
    assert cli("ls", "--tag", tag, "--tag", "nope", "--json").json() == []
    assert cli("rm", *ids).code == 0


def test_create_json_applies_every_option(cli, tag):
    made = cli(
        "create", "--memory-mb", "96", "--cpus", "0.5", "--pids", "64", "--timeout", "300",
        "--env", "A=1", "--env", "B=x=y", "--workdir", "/srv", "--tag", tag, "--json",
    ).json()
    assert len(made) == 1
    spec = made[0]["spec"]
    assert spec["memory_mb"] == 96 and spec["cpus"] == 0.5 and spec["pids"] == 64
    assert spec["env"] == {"A": "1", "B": "x=y"} and spec["workdir"] == "/srv"
    assert spec["tags"] == [tag] and spec["timeout"] == 300
    assert cli("rm", made[0]["id"]).code == 0


def test_invalid_create_is_reported_once(cli, tag):
    r = cli("create", "--memory-mb", "1", "--tag", tag, "-n", "3")
    assert r.code == 1 and r.out == ""
    lines = r.err.splitlines()
    assert lines[0] == "corral: 3 of 3 creates failed:"
    assert lines[1].startswith("corral: invalid sandbox spec: memory_mb") and "(x3)" in lines[1]


def test_pause_resume_stop_rm(cli, tag, client):
    sid = cli("create", "--memory-mb", "64", "--tag", tag).out.strip()
    assert cli("pause", sid).out.strip() == sid
    assert _states(cli, tag) == {sid: "paused"}
    r = cli("exec", sid, "--", "true")
    assert r.code == 1 and "paused" in r.err and r.err.startswith("corral: ")
    assert cli("resume", sid).out.strip() == sid
    assert _states(cli, tag) == {sid: "running"}
    assert cli("stop", "--grace", "1", sid).code == 0
    assert _states(cli, tag) == {sid: "stopped"}
    assert "-" in cli("ls", "--tag", tag).out  # no usage for a stopped sandbox
    assert cli("rm", sid).out.strip() == sid
    assert _states(cli, tag) == {}


def test_lifecycle_reports_each_unknown_id(cli, sandbox):
    r = cli("pause", sandbox.id, "sb-000000000000")
    assert r.code == 1 and r.out.strip() == sandbox.id
    assert "1 of 2 pausing failed" in r.err and "sb-000000000000" in r.err
    assert sandbox.refresh().state == corral.SandboxState.PAUSED


def test_rm_by_tag_deletes_the_sandboxes_with_every_tag(cli, tag, client):
    both = cli("create", "--memory-mb", "64", "--tag", tag, "--tag", "job=1", "-n", "12").out.split()
    other = cli("create", "--memory-mb", "64", "--tag", tag).out.strip()
    assert len(both) == 12

    refused = cli("rm", "--tag", tag, "--tag", "job=1")  # no terminal to ask on, no -y
    assert refused.code == 1 and "pass -y" in refused.err
    assert len(_states(cli, tag)) == 13

    r = cli("rm", "--tag", tag, "--tag", "job=1", "-y")
    assert r.code == 0 and r.out.strip() == "deleted 12 sandboxes"
    assert _states(cli, tag) == {other: "running"}

    cli("stop", other)
    assert cli("rm", "--tag", tag, "--state", "running", "-y").out.startswith("deleted 0")
    assert cli("rm", "--tag", tag, "--state", "stopped", "-y").out.strip() == "deleted 1 sandboxes"
    assert _states(cli, tag) == {}


def test_rm_usage_errors(cli, sandbox, tag):
    assert cli("rm").code == 2
    r = cli("rm", sandbox.id, "--tag", tag)
    assert r.code == 2 and "not both" in r.err
    assert sandbox.refresh().state == corral.SandboxState.RUNNING


def test_info(cli, sandbox):
    data = cli("info", "--json").json()
    assert data["counts"]["running"] >= 1 and data["committed_memory_mb"] >= 64
    assert {"max_starting", "max_sandboxes", "max_memory_mb"} <= set(data["capacity"])
    text = cli("info")
    assert text.code == 0
    assert f"version {corral.__version__}" in text.out and "committed" in text.out
    assert f"running {data['counts']['running']}" in text.out


def test_unknown_sandbox_is_a_message_not_a_traceback(cli_process):
    for args in (["exec", "sb-000000000000", "--", "true"], ["pause", "sb-000000000000"],
                 ["cp", "sb-000000000000:/x", "/tmp/x"]):
        r = cli_process(*args)
        assert r.code == 1, args
        assert r.err == "corral: no sandbox 'sb-000000000000': it never existed or was deleted\n"


def test_rm_is_idempotent_like_the_api(cli, sandbox):
    r = cli("rm", "sb-000000000000", sandbox.id)
    assert r.code == 0 and r.out == f"{sandbox.id}\n"
    assert r.err == ("corral: sb-000000000000: no such sandbox (deleted already, or never "
                     "made): nothing to delete\n")
    again = cli("rm", sandbox.id)
    assert again.code == 0 and again.out == "" and "nothing to delete" in again.err


def test_create_n_is_all_or_nothing_at_capacity(make_daemon, capsys, tag):
    from corral.cli.main import main

    d = make_daemon("--max-sandboxes", "2", "--queue-size", "0")
    code = main(["--url", d.url, "create", "--memory-mb", "64", "--tag", tag, "-n", "3"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    err = captured.err.splitlines()
    assert err[0] == "corral: 1 of 3 creates failed:"
    assert err[-1].startswith("corral: deleted the 2 sandboxes that were made (all or nothing): sb-")
    with corral.Client(d.url) as c:
        assert [sb.state for sb in corral.Sandbox.list(tags=[tag], client=c)] == []


def test_inspect_shows_spec_state_reason_usage_and_processes(cli, sandbox, tag):
    proc = sandbox.spawn(["sleep", "300"])
    r = cli("inspect", sandbox.id)
    assert r.code == 0, r.err
    assert "running" in r.out and "memory_mb" in r.out and "64" in r.out and tag in r.out
    assert "MB memory" in r.out and proc.id in r.out and "sleep 300" in r.out
    data = cli("inspect", sandbox.id, "--json").json()
    assert data["id"] == sandbox.id and data["usage"]["memory_mb"] >= 0
    assert [p["id"] for p in data["processes"]] == [proc.id]
    proc.kill()
    sandbox.stop()
    stopped = cli("inspect", sandbox.id, "--json").json()
    assert stopped["state"] == "stopped" and stopped["reason"]
    assert stopped["reason"] in cli("inspect", sandbox.id).out
    listed = cli("ls", "--tag", tag)
    assert "REASON" in listed.out and stopped["reason"] in listed.out
    assert cli("inspect", "sb-000000000000").code == 1


def test_help_texts_show_no_rst_markup(cli_process):
    for command in ("cp", "eval", "rm", "create"):
        r = cli_process(command, "-h")
        assert r.code == 0 and "``" not in r.out, command


def test_serve_runs_a_daemon():
    base = _base_dir()
    sock = base / "corral.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.cli.main", "serve", "--socket", str(sock),
         "--state-dir", str(base / "state"), "--max-sandboxes", "7"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_socket(sock, proc)
        with corral.Client(f"unix://{sock}") as c:
            assert c.info()["capacity"]["max_sandboxes"] == 7
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)
