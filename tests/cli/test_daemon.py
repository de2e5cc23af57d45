"""corral daemon status|stop|restart, and corral serve next to a running daemon."""

from __future__ import annotations

import corral
from corral.cli._daemon import peer_pid
from corral.cli.main import main
from tests.conftest import requires_root

pytestmark = requires_root


def _run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_daemon_status_and_stop(make_daemon, capsys, tmp_path):
    d = make_daemon()
    code, out, _ = _run(capsys, "--url", d.url, "daemon", "status")
    assert code == 0 and f"pid {d.proc.pid}, version {corral.__version__}, corral serve" in out

    # serve on the same socket says which daemon is there and how to stop it
    code, _, err = _run(capsys, "serve", "--socket", str(d.socket), "--state-dir", str(d.state_dir))
    assert code == 1 and f"(pid {d.proc.pid})" in err
    assert f"corral daemon stop --url unix://{d.socket}" in err
    assert d.proc.poll() is None

    with corral.Client(d.url) as c:
        sb = corral.Sandbox.create(memory_mb=64, client=c)
    code, _, err = _run(capsys, "--url", d.url, "daemon", "stop")
    assert code == 1 and "1 live sandboxes" in err and "-y" in err
    assert d.proc.poll() is None and sb.id

    code, out, _ = _run(capsys, "--url", d.url, "daemon", "stop", "-y")
    assert code == 0 and out == f"stopped the daemon (pid {d.proc.pid}) on {d.socket}\n"
    assert d.proc.wait(60) is not None

    code, out, _ = _run(capsys, "--url", d.url, "daemon", "status")
    assert code == 1 and out == f"no daemon answers on {d.socket}\n"
    code, out, _ = _run(capsys, "--url", d.url, "daemon", "stop")
    assert code == 0 and "nothing to stop" in out


def test_daemon_restart_keeps_the_sandboxes_running(make_daemon, capsys):
    d = make_daemon("--shutdown-grace", "0.5")
    with corral.Client(d.url) as c:
        sb = corral.Sandbox.create(memory_mb=64, timeout=600, client=c)
        sb.files.write("/tmp/kept", b"across the restart")
    old = d.proc.pid
    try:
        code, out, err = _run(capsys, "--url", d.url, "daemon", "restart")
        assert code == 0, err
        assert f"(pid {old} -> " in out and "1 of 1 live sandboxes kept running" in out
        assert d.proc.wait(60) == 0  # the old one exited cleanly, handing over
        new = peer_pid(str(d.socket))
        assert new not in (None, old)
        with corral.Client(d.url) as c:
            sb = corral.Sandbox.connect(sb.id, client=c)
            assert sb.state == corral.SandboxState.RUNNING
            assert sb.files.read("/tmp/kept") == b"across the restart"
            assert sb.exec("echo still here").stdout.strip() == "still here"
    finally:  # the new daemon is not the fixture's: stop whichever answers (and the sandbox)
        if peer_pid(str(d.socket)) not in (None, old):
            code, _, err = _run(capsys, "--url", d.url, "daemon", "stop", "-y")
            assert code == 0, err
