"""Fetch what Ray's own sandboxes need on Debian 12 into a private prefix (``make bench``).

    python3 benchmarks/setup_ray_sandbox.py [--force] [--dir DIR]

``ray.experimental.sandbox`` (ray 2.60) needs ``mkfs.erofs`` from erofs-utils >= 1.7
(bookworm has 1.5) and a runsc that boots an EROFS root (bookworm has none new enough).
This takes trixie's erofs-utils (with the trixie libraries it links, C library
included: it is run through that C library's own loader) and bookworm-backports' static
runsc from the Debian archive the host already uses, without touching the host's apt
sources, lists or packages: a private apt configuration and state under DIR/apt (removed afterwards),
``apt-get download`` and ``dpkg-deb -x`` into DIR/root. DIR/bin then holds
``mkfs.erofs`` (a wrapper) and ``runsc``, checked (versions, ``--tar``, the EROFS root
annotations), and DIR/tools.json says what is there; the benchmarks put DIR/bin first
on PATH (``peers/ray_sandbox.py``). DIR defaults to ``$CORRAL_CACHE_DIR/bench/ray-sandbox``
(``CORRAL_RAY_SANDBOX_TOOLS`` overrides it).

Idempotent: when tools.json is there and its tools pass the checks, nothing is fetched.
Needs root (apt-get). Exit status 1, with the reason, when it cannot set them up.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from peers.ray_sandbox import (
    EROFS_MIN_VERSION,
    RUNSC_MIN_VERSION,
    TOOLS_FILE,
    runsc_boots_erofs,
    tools_dir,
)

EROFS_SUITE, RUNSC_SUITE = "trixie", "bookworm-backports"
DEFAULT_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
WRAPPER = """#!/bin/sh
# trixie's mkfs.erofs, run through trixie's C library (bookworm's is too old for it)
exec "{ld}" --library-path "{libs}" "{exe}" "$@"
"""


class SetupError(Exception):
    pass


def host_codename(os_release: str) -> str:
    for line in os_release.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "VERSION_CODENAME":
            return value.strip().strip('"')
    raise SetupError("/etc/os-release names no VERSION_CODENAME")


def _stanzas(text: str) -> list[dict[str, str]]:
    """deb822 (``*.sources``) stanzas, comments dropped, keys lower-cased."""
    out, cur = [], {}
    for raw in text.splitlines() + [""]:
        if raw.lstrip().startswith("#"):
            continue  # a comment line, which does not end a stanza
        line = raw.rstrip()
        if not line:
            if cur:
                out.append(cur)
            cur = {}
            continue
        if line[0].isspace() or ":" not in line:
            continue  # continuation lines (multi-line Signed-By keys) are not needed
        key, _, value = line.partition(":")
        cur[key.strip().lower()] = value.strip()
    return out


def debian_archive(sources: dict[str, str], codename: str) -> tuple[str, str]:
    """The (URI, keyring) of the archive serving ``codename`` main to this host.

    ``sources`` maps each apt sources file's name to its text: deb822 ``*.sources``
    and one-line ``*.list``. Security and other suites' entries do not count."""
    for name, text in sorted(sources.items()):
        if name.endswith(".sources"):
            for st in _stanzas(text):
                if (st.get("enabled", "yes").lower() != "no" and "deb" in st.get("types", "").split()
                        and codename in st.get("suites", "").split()
                        and "main" in st.get("components", "").split() and st.get("uris")):
                    keyring = st.get("signed-by", "")
                    return st["uris"].split()[0], keyring if keyring.startswith("/") else DEFAULT_KEYRING
        elif name.endswith(".list"):
            for raw in text.splitlines():
                m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)", raw.split("#", 1)[0])
                if m and m.group(3) == codename and "main" in m.group(4).split():
                    opts = m.group(1) or ""
                    k = re.search(r"signed-by=(\S+?)[\s\]]", opts)
                    return m.group(2), k.group(1) if k else DEFAULT_KEYRING
    raise SetupError(f"no apt source of this host serves Debian {codename} main "
                     "(looked in /etc/apt/sources.list and sources.list.d)")


def host_sources(root: Path = Path("/etc/apt")) -> dict[str, str]:
    files = [root / "sources.list", *sorted((root / "sources.list.d").glob("*"))]
    return {str(p): p.read_text() for p in files if p.is_file()}


def closure(depends_output: str) -> list[str]:
    """Package names from ``apt-cache depends --recurse`` (virtual ``<names>`` left out)."""
    names = {ln.strip() for ln in depends_output.splitlines()
             if ln and not ln[0].isspace() and not ln.startswith("<")}
    return sorted(names)


def version_at_least(version: str, minimum: str) -> bool:
    """Debian version order, as dpkg itself compares."""
    return subprocess.run(["dpkg", "--compare-versions", version, "ge", minimum]).returncode == 0


class PrivateApt:
    """apt-get/apt-cache with their own sources, lists and cache: the host's stay as they are."""

    def __init__(self, base: Path, uri: str, keyring: str, arch: str):
        self.base = base
        for d in ("etc/sources.list.d", "etc/preferences.d", "etc/apt.conf.d",
                  "state/lists/partial", "cache/archives/partial"):
            (base / d).mkdir(parents=True, exist_ok=True)
        (base / "state/status").touch()
        (base / "etc/sources.list").write_text("".join(
            f"deb [signed-by={keyring}] {uri} {suite} main\n"
            for suite in (EROFS_SUITE, RUNSC_SUITE)))
        etc, st = base / "etc", base / "state"
        self.opts = [
            f"-oDir::Etc::sourcelist={etc}/sources.list",
            f"-oDir::Etc::sourceparts={etc}/sources.list.d",
            f"-oDir::Etc::preferences={etc}/preferences",
            f"-oDir::Etc::preferencesparts={etc}/preferences.d",
            f"-oDir::Etc::parts={etc}/apt.conf.d",
            f"-oDir::State={st}", f"-oDir::State::status={st}/status",
            f"-oDir::Cache={base}/cache", f"-oAPT::Architecture={arch}",
            "-oAPT::Sandbox::User=root", "-oDebug::NoLocking=1",
        ]

    def run(self, tool: str, *args: str, cwd: Path | None = None) -> str:
        r = subprocess.run([tool, *self.opts, *args], capture_output=True, text=True, cwd=cwd)
        if r.returncode != 0:
            raise SetupError(f"{tool} {' '.join(args)} failed: "
                             f"{(r.stderr or r.stdout).strip()[-600:]}")
        return r.stdout


def deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True,
                          check=True).stdout.strip()


def verify(d: Path) -> dict[str, str]:
    """Check the tools in ``d``/bin; what they are, or SetupError saying what is wrong."""
    mkfs, runsc = d / "bin/mkfs.erofs", d / "bin/runsc"
    for exe in (mkfs, runsc):
        if not os.access(exe, os.X_OK):
            raise SetupError(f"{exe} is missing")
    r = subprocess.run([str(mkfs), "--help"], capture_output=True, text=True)
    if "--tar" not in r.stdout + r.stderr:
        raise SetupError(f"{mkfs} does not run or has no --tar: {(r.stderr or r.stdout)[-300:]}")
    m = re.search(r"mkfs\.erofs \(erofs-utils\) (\S+)",
                  subprocess.run([str(mkfs), "--version"], capture_output=True, text=True).stdout)
    if not m or not version_at_least(m.group(1), EROFS_MIN_VERSION):
        raise SetupError(f"{mkfs} is not erofs-utils >= {EROFS_MIN_VERSION}")
    out = subprocess.run([str(runsc), "--version"], capture_output=True, text=True).stdout
    v = re.search(r"runsc version (\S+)", out)
    if not v or not version_at_least(v.group(1), RUNSC_MIN_VERSION):
        raise SetupError(f"{runsc} is not runsc >= {RUNSC_MIN_VERSION}: {out.strip()[:200]}")
    if not runsc_boots_erofs(str(runsc)):
        raise SetupError(f"{runsc} cannot boot an EROFS root (no dev.gvisor.spec.rootfs)")
    return {"erofs_utils": m.group(1), "runsc": v.group(1)}


def install(d: Path) -> dict[str, str]:
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    uri, keyring = debian_archive(host_sources(), host_codename(Path("/etc/os-release").read_text()))
    apt = PrivateApt(d / "apt", uri, keyring, arch)
    apt.run("apt-get", "-q", "update")
    wanted = closure(apt.run("apt-cache", "depends", "--recurse", "--no-recommends",
                             "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces",
                             "--no-enhances", f"erofs-utils/{EROFS_SUITE}"))
    debs = Path(tempfile.mkdtemp(prefix="debs-", dir=d))
    try:
        apt.run("apt-get", "-q", "download", *[f"{p}/{EROFS_SUITE}" for p in wanted],
                f"runsc/{RUNSC_SUITE}", cwd=debs)
        got = {deb_field(p, "Package"): (p, deb_field(p, "Version")) for p in debs.glob("*.deb")}
        if not version_at_least(got["erofs-utils"][1], EROFS_MIN_VERSION):
            raise SetupError(f"{EROFS_SUITE} has erofs-utils {got['erofs-utils'][1]}, "
                             f"Ray needs >= {EROFS_MIN_VERSION}")
        if not version_at_least(got["runsc"][1], RUNSC_MIN_VERSION):
            raise SetupError(f"{RUNSC_SUITE} has runsc {got['runsc'][1]}, "
                             f"Ray needs >= {RUNSC_MIN_VERSION}")
        root = d / "root"
        shutil.rmtree(root, ignore_errors=True)
        for deb, _ in got.values():
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    finally:
        shutil.rmtree(debs, ignore_errors=True)
        shutil.rmtree(d / "apt", ignore_errors=True)  # lists and caches: not needed again
    loaders = sorted(glob.glob(str(root / "usr/lib/*/ld-linux*.so*")))
    if not loaders:
        raise SetupError(f"trixie's libc6 has no loader under {root}/usr/lib")
    ld = Path(loaders[0])
    bin_dir = d / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "mkfs.erofs"
    wrapper.write_text(WRAPPER.format(ld=ld, libs=ld.parent, exe=root / "usr/bin/mkfs.erofs"))
    wrapper.chmod(0o755)
    link = bin_dir / "runsc"
    link.unlink(missing_ok=True)
    link.symlink_to(root / "usr/bin/runsc")
    found = verify(d)
    (d / TOOLS_FILE).write_text(json.dumps({"bin": str(bin_dir), **found}, indent=2) + "\n")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="fetch again even if set up")
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    d = (args.dir or tools_dir()).absolute()
    if not args.force and (d / TOOLS_FILE).is_file():
        try:
            found = verify(d)
            print(f"Ray sandbox tools ready in {d}/bin: erofs-utils {found['erofs_utils']}, "
                  f"runsc {found['runsc']}")
            return 0
        except SetupError as exc:
            print(f"Ray sandbox tools in {d} fail their checks ({exc}): fetching again")
    if os.geteuid() != 0:
        print("setup_ray_sandbox: needs root (apt-get, dpkg-deb)", file=sys.stderr)
        return 1
    d.mkdir(parents=True, exist_ok=True)
    try:
        found = install(d)
    except (SetupError, subprocess.CalledProcessError, OSError, KeyError) as exc:
        print(f"setup_ray_sandbox: could not set up Ray's sandbox tools: {exc}", file=sys.stderr)
        (d / TOOLS_FILE).unlink(missing_ok=True)
        return 1
    print(f"Ray sandbox tools in {d}/bin: erofs-utils {found['erofs_utils']} ({EROFS_SUITE}), "
          f"runsc {found['runsc']} ({RUNSC_SUITE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
