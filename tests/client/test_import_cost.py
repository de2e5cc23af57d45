"""What ``import corral`` loads, in a fresh interpreter: every reward worker, rollout
process and ``corral`` command line pays for it (``benchmarks/bench_import.py`` measures
the CPU). The names of ``corral.__all__`` are imported on first use (``corral._lazy``);
a sandbox user loads the sandbox half of the blocking client, not the asyncio twin,
images, pools, networks, volumes, the cluster client or httpx's command line (click,
rich); and corral's pydantic models are built on first use, not at import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, sys
    import corral
    bare = sorted(sys.modules)
    for name in sys.argv[1:]:
        getattr(corral, name)
    from corral.api import daemon_models
    print(json.dumps({"bare": bare, "used": sorted(sys.modules),
                      "built": daemon_models.TokenRequest.__pydantic_complete__}))
""")


def _probe(*names: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *names], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _loaded(modules: list[str], *prefixes: str) -> list[str]:
    return [m for m in modules if m.startswith(prefixes)]


def test_import_corral_loads_the_errors_only():
    got = _probe()
    assert "corral.errors" in got["bare"]
    assert not _loaded(got["bare"], "corral.client", "corral.api", "corral.schema", "httpx",
                       "httpcore", "pydantic", "anyio", "asyncio")


def test_a_sandbox_user_loads_the_sandbox_half_only():
    got = _probe("Sandbox", "Client", "CommandResult", "SandboxTimeout")
    assert "corral.client._sync._sandbox" in got["used"] and "httpx" in got["used"]
    assert not _loaded(got["used"], "corral.client._async", "corral.client._sync._pool",
                       "corral.client._sync._image", "corral.client._sync._session",
                       "corral.client._sync._network", "corral.client._sync._volume",
                       "corral.client._build", "corral.cluster", "corral.rl",
                       "corral.runtime", "corral.server", "httpx._main", "click", "rich",
                       "pygments")
    assert got["built"] is False  # a daemon-only model, declared but not built


def test_every_public_name_still_imports_on_first_use():
    got = _probe("AsyncPool", "Image", "BuildSpec", "PoolInfo", "NetworkPolicy", "submit")
    assert {"corral.client._async._pool", "corral.client._sync._image",
            "corral.image_schema", "corral.client._futures"} <= set(got["used"])
    proc = subprocess.run(
        [sys.executable, "-c", "from corral import *; import corral; "
         "print(sorted(set(corral.__all__) - set(globals())), "
         "sorted(set(corral.__all__) - set(dir(corral))))"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[] []", proc.stderr
