"""Registry pulls and Dockerfile builds, against baselines measured in the same run.

    python3 benchmarks/bench_registry.py [--quick|--smoke] [--json OUT]

A private image cache (a temporary ``CORRAL_CACHE_DIR``) and Debian's docker-registry
on 127.0.0.1. Medians of interleaved rounds:

- pull of a ~500 MB image (5 plain-tar layers of random bytes) by corral (download,
  digest check, unpack into overlay layers) vs ``skopeo copy docker://... oci:DIR``
  (download and digest check only: no unpacking) — the ratio corral / skopeo;
- time to the first command in a sandbox of a freshly pulled image (create + ``true``);
- 20 images sharing a base layer: the layer store's disk use vs the sum of the images'
  sizes;
- a 10-step Dockerfile (FROM a pulled image) built, then rebuilt with one step changed:
  rebuild / first build.

Needs root (sandboxes, overlay whiteouts) and ``docker-registry`` and ``skopeo``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from corral.runtime.paths import default_cache_dir  # noqa: E402

PYTHON_ROOTFS = default_cache_dir() / "images/python/rootfs"  # the host's, read only
CACHE = Path(tempfile.mkdtemp(prefix="corral-bench-registry-"))
os.chmod(CACHE, 0o711)
os.environ["CORRAL_CACHE_DIR"] = str(CACHE / "cache")

from bench_args import parser, pick  # noqa: E402
from tests.runtime.oci_archives import Layer  # noqa: E402
from tests.runtime.oci_archives import oci_layout as _oci_layout  # noqa: E402
from tests.runtime.registries import rootfs_layer, run_registry  # noqa: E402

from corral.runtime.distribution import RegistryClient, parse_reference  # noqa: E402
from corral.runtime.dockerfile_build import build_dockerfile  # noqa: E402
from corral.runtime.engine import Engine  # noqa: E402
from corral.runtime.image_pull import pull_image  # noqa: E402
from corral.runtime.images import ImageStore  # noqa: E402

CONFIG = {"architecture": "amd64", "os": "linux",
          "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]}}


def oci_layout(dest: Path, layers: list[bytes], *, gzip_layers: bool) -> Path:
    return _oci_layout(dest, layers, CONFIG, gzip_layers=gzip_layers)


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def big_layout(dest: Path, total_mb: int) -> Path:
    layers = []
    for i in range(5):
        layers.append(Layer().file(f"data/part{i}.bin",
                                   secrets.token_bytes(total_mb * (1 << 20) // 5)).bytes())
    return oci_layout(dest, layers, gzip_layers=False)


def skopeo_copy(ref: str, dest: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{ref}",
                    f"oci:{dest}"], check=True, capture_output=True)
    return time.perf_counter() - started


def client_download(ref: str, dest: Path) -> float:
    """corral's registry client alone: manifest, config and layer blobs to files,
    each hashed as it arrives (what skopeo copy does, without unpacking)."""
    started = time.perf_counter()
    client = RegistryClient(parse_reference(ref))
    dest.mkdir()
    try:
        manifest, _, _ = client.manifest(client.ref.reference)
        for desc in (manifest["config"], *manifest["layers"]):
            resp, _ = client.blob_stream(desc["digest"])
            h = hashlib.sha256()
            with open(dest / desc["digest"][7:], "wb") as f:
                while chunk := resp.read(1 << 20):
                    h.update(chunk)
                    f.write(chunk)
            resp.close()
            assert "sha256:" + h.hexdigest() == desc["digest"]
    finally:
        client.close()
    return time.perf_counter() - started


def corral_pull(ref: str, images_dir: Path) -> float:
    store = ImageStore(images_dir)
    started = time.perf_counter()
    pull_image(store, ref)
    return time.perf_counter() - started


async def first_command(engine: Engine, ref: str) -> float:
    image = await asyncio.to_thread(pull_image, engine.images, ref)
    started = time.perf_counter()
    sb = await engine.create(image=image.name)
    await engine.exec(sb.id, ["true"])
    took = time.perf_counter() - started
    await engine.delete(sb.id)
    return took


async def dockerfile_builds(engine: Engine, base_ref: str, tmp: Path) -> dict[str, float]:
    ctx = tmp / "ctx"
    ctx.mkdir()

    def write(changed: str) -> None:
        steps = [f"RUN head -c 4000000 /dev/urandom > /opt/f{i}" if i != 5
                 else f"RUN echo {changed} > /opt/f5"
                 for i in range(10)]
        (ctx / "Dockerfile").write_text(f"FROM {base_ref}\n" + "\n".join(steps) + "\n")

    write("first")
    first = await build_dockerfile(engine, ctx, name="bench-df")
    write("second")
    again = await build_dockerfile(engine, ctx, name="bench-df")
    return {"first_build_s": first.stats.seconds, "rebuild_one_changed_s": again.stats.seconds,
            "rebuild_steps_run": float(again.stats.built)}


async def main_async(args: argparse.Namespace) -> dict[str, float]:
    res: dict[str, float] = {}
    size_mb = pick(args, 500, 100, 5)
    rounds = pick(args, 3, 2, 1)
    tmp = CACHE / "work"
    tmp.mkdir()
    with run_registry(tmp / "registry") as registry:
        big = registry.push(big_layout(tmp / "big", size_mb), "bench/big:1")
        ours, theirs, client = [], [], []
        for r in range(rounds):  # interleaved, so drift hits all three alike
            theirs.append(skopeo_copy(big, tmp / f"skopeo-{r}"))
            shutil.rmtree(tmp / f"skopeo-{r}")
            client.append(client_download(big, tmp / f"client-{r}"))
            shutil.rmtree(tmp / f"client-{r}")
            ours.append(corral_pull(big, tmp / f"images-{r}"))
            shutil.rmtree(tmp / f"images-{r}")
        mb = f"{size_mb}mb"
        res[f"pull_{mb}_corral_s"] = statistics.median(ours)
        res[f"download_{mb}_corral_client_s"] = statistics.median(client)
        res[f"copy_{mb}_skopeo_s"] = statistics.median(theirs)
        res["pull_ratio_corral_over_skopeo"] = res[f"pull_{mb}_corral_s"] / res[f"copy_{mb}_skopeo_s"]
        res["download_ratio_client_over_skopeo"] = (res[f"download_{mb}_corral_client_s"]
                                                    / res[f"copy_{mb}_skopeo_s"])

        base = rootfs_layer(PYTHON_ROOTFS)
        base_ref = registry.push(oci_layout(tmp / "base", [base], gzip_layers=False),
                                 "bench/python:1")
        engine = await Engine.open(CACHE / "state")
        try:
            firsts = []
            for i in range(rounds):
                ref = registry.push(oci_layout(tmp / f"first{i}", [base, Layer().file(
                    "srv/x", str(i).encode()).bytes()], gzip_layers=False), f"bench/first:{i}")
                firsts.append(await first_command(engine, ref))
            res["first_command_after_pull_s"] = statistics.median(firsts)

            n = pick(args, 20, 6, 2)
            sizes = 0
            for i in range(n):
                ref = registry.push(oci_layout(tmp / f"share{i}", [base, Layer().file(
                    "task/id", f"task {i}".encode()).bytes()], gzip_layers=False),
                    f"bench/share:{i}")
                sizes += (await asyncio.to_thread(pull_image, engine.images, ref)).size_bytes
            used = du(engine.images.images_dir / ".layers")
            res[f"shared_base_{n}_images_sum_mb"] = sizes / 1e6
            res[f"shared_base_{n}_images_disk_mb"] = used / 1e6
            res["shared_base_disk_over_sum"] = used / sizes
            res.update(await dockerfile_builds(engine, base_ref, tmp))
            res["rebuild_over_first_build"] = res["rebuild_one_changed_s"] / res["first_build_s"]
        finally:
            await engine.close()
    return res


def main() -> int:
    args = parser(__doc__).parse_args()
    if os.geteuid() != 0 or not shutil.which("docker-registry") or not shutil.which("skopeo"):
        print("needs root, docker-registry and skopeo")
        return 1
    try:
        res = asyncio.run(main_async(args))
    finally:
        shutil.rmtree(CACHE, ignore_errors=True)
    for k, v in res.items():
        print(f"{k:40s} {v:10.3f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
