#!/usr/bin/env bash
# Installs everything corral needs on a fresh Debian 12 machine (run as root):
# Debian packages, a virtualenv with corral and its dev extras, and the built-in images.
set -euo pipefail
cd "$(dirname "$0")/.."

# nftables: the egress filter of sandboxes with a network policy (docs/network.md)
# chromium: the dashboard's browser test (Playwright drives it; it never downloads a browser)
# docker-registry, skopeo: a local registry for the image pull tests (docs/agentic.md)
# zstd: unpacks zstd-compressed image layers (corral.runtime.layer_codec)
# musl-tools: the agent is linked against musl, whose start runs no CPUID probes
# (corral.runtime.agentbuild; without it, glibc)
APT_PACKAGES=(bubblewrap debootstrap gcc libc6-dev musl-tools make python3-venv iproute2 nftables util-linux e2fsprogs procps chromium
              docker-registry skopeo zstd)
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# CRIU >= 4.2 for live checkpoints (docs/live.md), built once from Debian sid's source
# package and cached under the image cache (~2 min the first time; instant once cached)
bash scripts/build_criu.sh || echo "warning: CRIU was not built: live checkpoints stay off" >&2

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
    done
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=".venv/.corral-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # pyproject.toml says what corral needs (lower bounds); constraints.txt pins the
    # versions tested here, so CI is reproducible
    .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[daemon,dev,rl,trl,compat,ray,gpu,docs,uvloop]"
    touch "$stamp"
fi

# Build (or reuse the cached) default image, the agent binary and the built-in images
# (rl; fusion: g++, nodejs and pytest by apt in a `user: root` build step, ~20 s; judge:
# gcc, OpenJDK, Go and Rust on fusion for the code judge, ~25 s and ~1 GB more;
# code-interpreter: numpy, pandas, matplotlib for E2B's Code Interpreter, ~13 s). The
# compat extra above brings the clients the compat tests drive (tensorlake, cwsandbox,
# sandbox-fusion).
.venv/bin/python -m corral.runtime.prepare

# The command where deploy/corral.service runs it (ExecStart): a link to this install,
# when run as root and nothing else is there already.
INSTALLED_AS=/usr/local/bin/corral
if [ "$(id -u)" = 0 ] && [ -d "$(dirname "$INSTALLED_AS")" ] &&
   { [ ! -e "$INSTALLED_AS" ] || [ -L "$INSTALLED_AS" ]; }; then
    ln -sfn "$PWD/.venv/bin/corral" "$INSTALLED_AS"
fi
