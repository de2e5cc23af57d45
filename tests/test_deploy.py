"""deploy/: the systemd unit, the Prometheus scrape config and the Grafana dashboard.

The unit must be one systemd accepts, and its hardening must leave sandboxes working
(namespaces, cgroups, overlay mounts); the dashboard must query only metrics a real
daemon exports.
"""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime
from tests.server.conftest import uds_client

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNIT = DEPLOY / "corral.service"
INSTALLED_AS = "/usr/local/bin/corral"  # the unit's ExecStart
# The unit's hardening, and how test_hardening_leaves_sandboxes_working reproduces it
# without systemd: a key missing here fails that test until it is reproduced too.
EMULATED = {
    "NoNewPrivileges": "setpriv --no-new-privs",
    "ProtectSystem": "/usr, /boot, /etc read-only",
    "ProtectHome": "/home, /root read-only",
    "PrivateTmp": "not reproduced: a fresh /tmp, which corral does not share with anyone",
    "LockPersonality": ("not reproduced: corral calls personality(2) only to put back "
                        "PER_LINUX where it inherited another (agent/clean.c)"),
    "RestrictRealtime": ("not reproduced: corral asks for no realtime scheduling (it only "
                         "leaves one it inherited: agent/clean.c)"),
    "SystemCallArchitectures": "not reproduced: native only; sandboxes run native code",
}
READ_ONLY = {"ProtectSystem": ("/usr", "/boot", "/etc"), "ProtectHome": ("/home", "/root")}
NOT_HARDENING = {
    "Type", "EnvironmentFile", "Environment", "ExecStart", "StateDirectory",
    "StateDirectoryMode", "CacheDirectory", "CacheDirectoryMode", "RuntimeDirectory",
    "RuntimeDirectoryMode", "RuntimeDirectoryPreserve", "KillMode", "KillSignal",
    "TimeoutStopSec", "Restart", "RestartSec", "LimitNOFILE", "TasksMax", "OOMScoreAdjust",
    "Delegate",
}


def unit_service() -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return dict(parser["Service"])


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    corral = Path(sys.executable).parent / "corral"
    if not corral.exists():
        pytest.skip("no corral command next to this Python (pip install -e .)")
    # verify checks that ExecStart exists: point it at this install's corral
    unit = tmp_path / "corral.service"
    unit.write_text(UNIT.read_text().replace(INSTALLED_AS, str(corral)))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "corral.service" not in proc.stderr, proc.stderr  # no warning about our unit


def test_unit_runs_corral_serve_with_state_dir_restart_and_json_logs():
    service = unit_service()
    argv = service["ExecStart"].replace("\\\n", " ").split()
    assert argv[:2] == [INSTALLED_AS, "serve"]
    assert "--state-dir" in argv and "--log-format" in argv
    assert argv[argv.index("--log-format") + 1] == "json"
    # live restore: systemd signals the daemon only; its sandboxes outlive a restart
    assert service["Restart"] == "on-failure" and service["KillMode"] == "process"
    assert service.get("KillSignal", "SIGTERM") == "SIGTERM"
    for key in ("ProtectControlGroups", "ProtectKernelTunables", "PrivateDevices",
                "RestrictNamespaces", "DevicePolicy", "UMask", "RestrictSUIDSGID"):
        assert key not in service, f"{key} breaks sandboxes"


def test_make_install_puts_corral_where_the_unit_runs_it():
    install = (Path(__file__).resolve().parent.parent / "scripts" / "install.sh").read_text()
    assert f"INSTALLED_AS={INSTALLED_AS}\n" in install
    assert 'ln -sfn "$PWD/.venv/bin/corral" "$INSTALLED_AS"' in install
    if Path(INSTALLED_AS).is_symlink():  # installed here: it runs this checkout's corral
        assert Path(INSTALLED_AS).resolve().name == "corral"


def test_hardening_leaves_sandboxes_working():
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("needs setpriv and unshare (util-linux)")
    service = unit_service()
    hardening = set(service) - NOT_HARDENING
    assert hardening <= set(EMULATED), f"reproduce {hardening - set(EMULATED)} here"
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "full" and service["ProtectHome"] == "read-only"
    base = _base_dir()
    paths = [p for key in READ_ONLY for p in READ_ONLY[key] if Path(p).is_dir()]
    remounts = "; ".join(f"mount --bind {p} {p} && mount -o remount,bind,ro {p}" for p in paths)
    script = f'mount --make-rprivate / && {remounts} && exec setpriv --no-new-privs "$@"'
    d = Daemon(base, wrapper=["unshare", "--mount", "sh", "-ec", script, "sh"])
    try:
        d.start()
        with uds_client(d.socket) as c:
            reply = c.post("/v1/sandboxes", json={"memory_mb": 64})
            assert reply.status_code == 201, reply.text
            sid = reply.json()["id"]
            run = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": [
                "sh", "-c", "grep NoNewPrivs /proc/self/status; echo x > /tmp/w && cat /tmp/w"]})
            assert run.status_code == 200, run.text
            assert run.json()["stdout"] == "NoNewPrivs:\t1\nx\n"
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        status = Path(f"/proc/{d.proc.pid}/status").read_text()
        assert "NoNewPrivs:\t1" in status  # the daemon itself ran hardened
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_prometheus_config_scrapes_metrics_with_a_token_file():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"].startswith("/")
    assert "credentials" not in job["authorization"]  # never the token itself
    assert job["static_configs"][0]["targets"]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return exprs


def test_the_dashboard_queries_only_what_a_daemon_exports(daemon):
    with uds_client(daemon.socket) as c:
        reply = c.get("/metrics")
    assert reply.status_code == 200, reply.text
    families = list(text_string_to_metric_families(reply.text))
    exported = {f.name for f in families} | {s.name for f in families for s in f.samples}
    exprs = dashboard_exprs()
    used = {name for e in exprs for name in re.findall(r"\bcorral_[a-z0-9_]+", e)}
    assert used and used <= exported, used - exported
    # every figure the daemon exports has a panel (but the _created timestamps)
    figures = {f.name for f in families if not f.name.endswith("_created")}
    assert figures <= {re.sub(r"_(bucket|total)$", "", n) for n in used}
