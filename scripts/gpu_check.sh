#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a GPU machine that has no network and nothing
# of corral installed: run from the repository root as root, with build/gpu/ carried
# beside it (made by `scripts/gpu_check.sh --prepare` on a Debian machine with corral
# installed): bubblewrap, the static agent, cp312 wheels of the engine's dependencies,
# and corral's Debian `python` image as a tarball. Uses the machine's own PyTorch
# (TORCH_PY, default /opt/torch/.venv/bin/python). Results: $OUT/gpu_check.json, log.txt.
set -u
C=build/gpu
if [ "${1:-}" = "--prepare" ]; then
    set -e
    rm -rf "$C"; mkdir -p "$C/wheels" "$C/bin"
    cp "$(command -v bwrap)" "$C/bin/"
    .venv/bin/python -m pip download -q --python-version 3.12 --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$C/wheels" \
        "pydantic>=2.7" "httpx>=0.27" "rich>=13" "nvidia-ml-py>=12" click anyio
    agent=$(.venv/bin/python -c 'from corral.runtime.agentbuild import ensure_agent
from corral.runtime.paths import Layout, default_cache_dir, default_state_dir
print(ensure_agent(Layout(default_state_dir(), default_cache_dir())))')
    cp "$agent" "$C/bin/"
    images=$(.venv/bin/python -c 'from corral.runtime.paths import default_cache_dir; print(default_cache_dir())')/images
    tar -C "$images/python/rootfs" -cf - . | xz -T2 -6 > "$C/pyroot.tar.xz"
    cp "$images/python/manifest.json" "$C/pyroot-manifest.json"
    du -sh "$C"
    exit 0
fi
OUT=${OUT:-/tmp/gpu-out}
TORCH_PY=${TORCH_PY:-/opt/torch/.venv/bin/python}
W=$(mktemp -d /tmp/corral-gpu-XXXXXX)
# its own filesystem: an overlay refuses a lower layer (hostroot: the machine's root)
# that holds another of its layers (the agent's) or its upper dir (ELOOP)
mount -t tmpfs -o size=8g,mode=0711 corral-gpu "$W"
mkdir -p "$OUT" "$W/py" "$W/bin" "$W/state" "$W/cache/bin" "$W/cache/images" "$W/run"
{
echo "== machine"; uname -r; nvidia-smi -L; findmnt -no FSTYPE,SOURCE /; findmnt /opt || true
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; ls -l /dev/nvidia* 2>&1; command -v nvidia-smi nft ip
ldconfig -p | grep -E 'libcuda|libnvidia-ml' || echo "driver not in the ldconfig cache"
findmnt -rn -o TARGET,FSTYPE,OPTIONS | grep -E 'nvidia|/opt|^/ ' || true
unshare -Urm true && echo "userns: ok"; stat -c 'opt dev %d' /opt /opt/torch / 2>&1
stat -fc %T /sys/fs/cgroup; cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null; "$TORCH_PY" -V
"$TORCH_PY" - "$C/wheels" "$W/py" <<'PY'
import glob, sys, zipfile
for w in glob.glob(sys.argv[1] + "/*.whl"):
    zipfile.ZipFile(w).extractall(sys.argv[2])
PY
install -m 0755 "$C/bin/bwrap" "$W/bin/bwrap"
for a in "$C"/bin/corral-agent-*; do install -m 0755 "$a" "$W/cache/bin/"; done
"$W/bin/bwrap" --version
# hostroot: the machine's own root, read-only (its Python and PyTorch), as an image
mkdir -p "$W/cache/images/hostroot/rootfs"
mount --bind / "$W/cache/images/hostroot/rootfs" && mount -o remount,bind,ro "$W/cache/images/hostroot/rootfs"
echo '{"name": "hostroot", "digest": "sha256:host", "created_at": 0, "size_bytes": 0, "python": "/usr/bin/python3", "kind": "rootfs"}' > "$W/cache/images/hostroot/manifest.json"
if [ -f "$C/pyroot.tar.xz" ]; then
    mkdir -p "$W/cache/images/python/rootfs"
    tar -C "$W/cache/images/python/rootfs" -xJf "$C/pyroot.tar.xz" && cp "$C/pyroot-manifest.json" "$W/cache/images/python/manifest.json"
fi
echo "== check"
env PATH="$W/bin:$PATH" PYTHONPATH="$PWD/src:$W/py" CORRAL_STATE_DIR="$W/state" \
    CORRAL_CACHE_DIR="$W/cache" CORRAL_RUN_DIR="$W/run" OUT="$OUT" TORCH_PY="$TORCH_PY" \
    timeout 520 "$TORCH_PY" scripts/gpu_check.py
echo "== exit $?"
umount "$W/cache/images/hostroot/rootfs"; umount -l "$W"
} 2>&1 | tee "$OUT/log.txt"
