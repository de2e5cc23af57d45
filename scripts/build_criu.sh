#!/usr/bin/env bash
# Builds CRIU >= 4.2 (live checkpoints, docs/live.md) from Debian sid's *source* package on
# Debian 12 and caches the binary as $CORRAL_CACHE_DIR/criu/<version>/criu. Idempotent:
# a cached binary that passes `criu check` is reused at once. The host's apt sources are
# never touched: a private source list (deb-src for sid only) and a private lists dir.
# Build dependencies are Debian 12 packages, installed explicitly (only the `criu` binary is
# built: no docs, no plugins). Run as root. Exit 0 also when CRIU cannot be built (live
# checkpoints are optional; `corral doctor` says why they are off).
# corral's patches (scripts/criu/*.patch, each saying why) are applied to the upstream
# tree; the binary is cached as <version>-corral<PATCH_LEVEL> (corral.runtime.criu reads it).
set -euo pipefail
CACHE="${CORRAL_CACHE_DIR:-/var/cache/corral}"
MIN_VERSION="4.2"
PATCH_LEVEL=1  # = corral.runtime.criu.PATCH_LEVEL: bump it with each new patch
PATCHES="$(cd "$(dirname "$0")" && pwd)/criu"
DEST="$CACHE/criu"

have_cached() {
    local bin
    for bin in "$DEST"/*-corral"$PATCH_LEVEL"/criu; do
        [ -x "$bin" ] || continue
        local v="${bin%-corral*/criu}"; v="${v##*/}"
        if dpkg --compare-versions "$v" ge "$MIN_VERSION"; then echo "$bin"; return 0; fi
    done
    return 1
}

if bin=$(have_cached); then
    echo "criu: cached $bin"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "criu: not root, skipping the CRIU build (live checkpoints stay off)" >&2
    exit 0
fi

start=$(date +%s)
work=$(mktemp -d /tmp/corral-criu-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/src"
# the Debian archive's URI and keyring, as the host already uses them
uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$uri" ] || uri=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$uri" ] || { echo "criu: no Debian archive URI in the host's apt sources" >&2; exit 0; }
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri sid main" \
    > "$work/sources.list"
APT_OPTS=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=/nonexistent"
          -o "Dir::State::Lists=$work/lists" -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root" -qq)

# Build dependencies (Debian 12 packages) of the criu binary alone.
BUILD_DEPS=(build-essential pkg-config protobuf-c-compiler libprotobuf-c-dev protobuf-compiler
            libprotobuf-dev python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev
            libgnutls28-dev libnftables-dev uuid-dev libaio-dev dpkg-dev)
missing=()
for p in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "criu: installing build dependencies: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

apt-get "${APT_OPTS[@]}" update
# The upstream tarball is all the binary needs (Debian's own diff only packages it, and a
# registry may not serve it): fetch what it serves, then check the tarball against the
# sha256 in sid's signed Sources index before unpacking it.
( cd "$work/src" && apt-get "${APT_OPTS[@]}" source --download-only criu >/dev/null 2>&1 || true )
orig=$(ls "$work"/src/criu_*.orig.tar.* 2>/dev/null | head -1)
[ -n "$orig" ] || { echo "criu: the registry served no criu source from sid" >&2; exit 0; }
want=$(apt-cache "${APT_OPTS[@]}" showsrc criu | awk -v f="${orig##*/}" \
       '/^Checksums-Sha256:/{s=1; next} /^[^ ]/{s=0} s && $3==f {print $1; exit}')
have=$(sha256sum "$orig" | cut -d" " -f1)
[ -n "$want" ] && [ "$want" = "$have" ] || { echo "criu: ${orig##*/} does not match sid's Sources index" >&2; exit 1; }
version=$(echo "${orig##*/}" | sed -E 's/^criu_([0-9.]+)\.orig.*/\1/')
if ! dpkg --compare-versions "$version" ge "$MIN_VERSION"; then
    echo "criu: sid has $version (< $MIN_VERSION); live checkpoints stay off" >&2
    exit 0
fi
mkdir "$work/src/tree"
tar -xf "$orig" -C "$work/src/tree" --strip-components=1
tree="$work/src/tree"
for p in "$PATCHES"/*.patch; do
    patch -d "$tree" -p1 --quiet < "$p" || { echo "criu: $p does not apply to $version" >&2; exit 1; }
done
# only the binary: no docs, no plugins, no crit
make -C "$tree" -j"$(nproc)" criu >"$work/build.log" 2>&1 || {
    tail -30 "$work/build.log" >&2; echo "criu: build failed" >&2; exit 1; }
name="$version-corral$PATCH_LEVEL"
mkdir -p "$DEST/$name.tmp"
install -m 0755 "$tree/criu/criu" "$DEST/$name.tmp/criu"
chmod 0755 "$DEST"
rm -rf "${DEST:?}/$name"
mv "$DEST/$name.tmp" "$DEST/$name"
echo "criu: built $name in $(( $(date +%s) - start )) s -> $DEST/$name/criu"
"$DEST/$name/criu" check || echo "criu: \`criu check\` failed on this host (see corral doctor)" >&2
