#!/usr/bin/env bash
# Installs what the benchmark suite (benchmarks/, `make bench`) needs on top of
# scripts/install.sh, run as root on Debian 12: the peers it is measured against
# (Debian packages) and the `bench` extra (workloads, chart) in .venv. Idempotent:
# a second run installs nothing. A peer whose package cannot be installed is
# skipped by the suite with the reason, so a failed apt-get is a warning here.
set -euo pipefail
cd "$(dirname "$0")/.."

# runc, podman (+ conmon, catatonit, uidmap) and gVisor's runsc: the peers.
APT_PACKAGES=(runc podman conmon catatonit uidmap runsc)
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing Debian packages for the benchmark peers: ${missing[*]}"
    if ! { apt-get update -qq && \
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
        echo "warning: could not install ${missing[*]}; the suite skips those peers" >&2
    fi
fi

if [ ! -x .venv/bin/python ]; then
    echo "no .venv: run scripts/install.sh (make install) first" >&2
    exit 1
fi
stamp=".venv/.corral-bench-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q -e ".[bench]"
    touch "$stamp"
fi
