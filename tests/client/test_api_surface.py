"""The public surface of ``import corral``, and the generated blocking client."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import corral

ROOT = Path(__file__).resolve().parents[2]


def test_all_is_sorted_and_complete():
    assert corral.__all__ == sorted(corral.__all__)
    assert len(set(corral.__all__)) == len(corral.__all__)
    missing = [name for name in corral.__all__ if not hasattr(corral, name)]
    assert not missing
    exported = {
        name for name, obj in vars(corral).items()
        if not name.startswith("_") and not inspect.ismodule(obj)
    }
    assert exported == set(corral.__all__) - {"__version__"}
    assert corral.__version__ == "0.1.0"


def test_public_names_come_from_private_modules_and_the_error_tree():
    assert corral.SandboxNotFound is __import__("corral.errors").errors.SandboxNotFound
    for name in corral.__all__:
        obj = getattr(corral, name)
        module = getattr(obj, "__module__", "") or ""
        if inspect.isclass(obj) and module.startswith("corral.client"):
            assert any(part.startswith("_") for part in module.split(".")[2:]), (name, module)


def test_sync_and_async_twins_have_the_same_methods():
    pairs = [
        (corral.Sandbox, corral.AsyncSandbox),
        (corral.Client, corral.AsyncClient),
        (corral.Session, corral.AsyncSession),
        (corral.Files, corral.AsyncFiles),
        (corral.ExecStream, corral.AsyncExecStream),
        (corral.Snapshot, corral.AsyncSnapshot),
    ]
    renamed = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__",
               "__aiter__": "__iter__", "__anext__": "__next__"}
    for sync_cls, async_cls in pairs:
        async_names = {renamed.get(n, n) for n in dir(async_cls) if not n.startswith("_") or n in renamed}
        sync_names = {n for n in dir(sync_cls) if not n.startswith("_") or n in renamed.values()}
        assert async_names <= sync_names, (sync_cls, async_names - sync_names)
    assert inspect.iscoroutinefunction(corral.AsyncSandbox.exec)
    assert not inspect.iscoroutinefunction(corral.Sandbox.exec)
    assert {"create_future", "exec_future"} <= set(dir(corral.Sandbox)) - set(dir(corral.AsyncSandbox))


def test_generated_blocking_client_is_up_to_date():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_sync.py"), "--check"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_gen_sync_check_detects_a_stale_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_sync as script  # scripts/gen_sync.py
    finally:
        sys.path.pop(0)
    assert hasattr(script, "stale_files"), script.__file__
    expected = script.expected_files()
    assert expected and not script.stale_files(expected)
    path = next(iter(expected))
    assert script.stale_files({path: expected[path] + "# drift\n"})
    assert script.unasync_line("        async with await AsyncSandbox.create() as sb:\n") == (
        "        with Sandbox.create() as sb:\n"
    )
    assert script.unasync_line("already = await r.aread()  # StopAsyncIteration\n") == (
        "already = r.read()  # StopAsyncIteration\n"
    )


def test_import_has_no_side_effects():
    code = (
        "import sys, threading, corral\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "bad = [m for m in sys.modules if m.startswith(('corral.runtime', 'corral.server'))]\n"
        "assert not bad, bad\n"
    )
    env = {"PATH": "/usr/bin:/bin", "CORRAL_SOCKET": "/nonexistent/corral.sock"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert not Path("/nonexistent").exists()
