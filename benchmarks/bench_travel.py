"""Root images that travel: the first sandbox of a built image on a node without its root.

    python3 benchmarks/bench_travel.py [--quick] [--json OUT]

Two real daemons on this host, each with an image cache of its own (A: this host's
``python``, hard-linked; B: a copy of it with one file added, published under its own
recipe, so a different digest, as on two hosts that built ``python`` apart), that know
each other as cluster peers (``CORRAL_PEERS``: Ray would only supply the addresses).
Each round builds a fresh image on A (two small steps), then on B times, with the
blocking SDK (medians over the rounds, all in this run):

- ``first_use_root_missing_ms``: pull the image (its root, ``python``, ~150 MB, and its
  layers, from A's daemon, each checked against its digest), create a sandbox, ``exec``;
- ``first_use_root_present_ms``: the same for a second image built on the same root (the
  root is here now: only its layers cross);
- ``present_ms``: the same once the image is here (the baseline: nothing crosses).

Between rounds the images are deleted on B, which collects the pulled root, so every
round's first use crosses it again. ``root_content_digest_ms`` is A's one-off hash of
its root (the first time a peer asks; kept in its manifest).

Volumes travel the same way (:mod:`corral.runtime.volume_travel`): a volume of
``volume_mb`` of random bytes made on A, then on B ``volume_first_use_ms`` (its copy
fetched from A, a ``cow`` sandbox made on it, ``exec``), ``volume_present_ms`` (the same
with the copy there), and on A ``volume_home_ms`` (the baseline: the volume made there);
``volume_content_digest_ms`` is A's one-off hash of it. B's copy is removed between
rounds. Never fails on time.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
import httpx

import corral
from corral.runtime.images import ImageStore
from corral.runtime.paths import default_cache_dir

TOKEN = secrets.token_urlsafe(16)
SPEC = {"memory_mb": 64}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cache(base: Path, own_python: bool) -> Path:
    cache = base / "cache"
    (cache / "images").mkdir(parents=True)
    os.chmod(cache, 0o711)
    src = default_cache_dir()
    for part in ("bin", "share", *([] if own_python else ["images/python"])):
        subprocess.run(["cp", "-al", str(src / part), str(cache / part)], check=True)
    if own_python:  # this host's python with one file more: another tree, another digest
        work = base / "work"
        subprocess.run(["cp", "-al", str(src / "images/python/rootfs"), str(work)], check=True)
        (work / "etc/corral-node").write_text("b\n")
        manifest = json.loads((src / "images/python/manifest.json").read_text())
        ImageStore(cache / "images").add_rootfs(
            "python", work, move=True, source={**manifest["source"], "node": "b"},
            extra={"kind": "debootstrap", "debian": manifest.get("debian")})
    return cache


def _start(base: Path, cache: Path, port: int, peers: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, "CORRAL_TOKEN": TOKEN, "CORRAL_PEERS": json.dumps(peers),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.server", "--socket", str(base / "corral.sock"),
         "--state-dir", str(base / "state"), "--cache-dir", str(cache),
         "--tcp", f"127.0.0.1:{port}"],
        stdout=open(base / "daemon.log", "ab"), stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/images", timeout=5,
                         headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the daemon did not start: see {base / 'daemon.log'}")


def _build(client: corral.Client, name: str) -> None:
    mark = secrets.token_hex(8)
    corral.Image.build({"steps": [{"run": f"echo {mark} > /home/sandbox/mark"},
                                  {"run": "head -c 1000000 /dev/urandom > /home/sandbox/blob"}]},
                       name=name, client=client)


def _first_use(b: corral.Client, http: httpx.Client, name: str) -> float:
    """ms: make ``name`` usable on B (as the cluster client does), create, exec."""
    t = time.perf_counter()
    http.post("/v1/peer/images/fetch", json={"image": name, "node": "a"},
              timeout=900).raise_for_status()
    sb = corral.Sandbox.create(image=name, client=b, **SPEC)  # type: ignore[arg-type]
    sb.exec("cat /home/sandbox/mark", timeout=60)
    ms = (time.perf_counter() - t) * 1000
    sb.delete()
    return ms


def _volume_use(client: corral.Client, http: httpx.Client | None) -> float:
    """ms: (with ``http``, B's daemon: fetch the copy of A's volume, as the cluster
    client does) create a sandbox mounting it, read its blob's size."""
    t = time.perf_counter()
    if http is not None:
        http.post("/v1/cluster/volumes/fetch", json={"volume": "bench-vol", "node": "a"},
                  timeout=900).raise_for_status()
    sb = corral.Sandbox.create(volumes={"/data": "bench-vol"}, client=client, **SPEC)  # type: ignore[arg-type]
    sb.exec("wc -c /data/blob", timeout=60)
    ms = (time.perf_counter() - t) * 1000
    sb.delete()
    return ms


def _volumes(a: corral.Client, b: corral.Client, http_a: httpx.Client, http_b: httpx.Client,
             rounds: int, mb: int, top: Path) -> dict[str, float]:
    (top / "vol").mkdir()
    (top / "vol" / "blob").write_bytes(os.urandom(mb << 20))
    corral.Volume.create("bench-vol", top / "vol", client=a)
    t = time.perf_counter()
    http_a.get("/v1/peer/volumes/bench-vol").raise_for_status()
    out = {"volume_content_digest_ms": (time.perf_counter() - t) * 1000, "volume_mb": mb}
    first, present, home = [], [], []
    for _ in range(rounds):
        first.append(_volume_use(b, http_b))
        present.append(_volume_use(b, http_b))
        home.append(_volume_use(a, None))
        http_b.delete("/v1/volumes/bench-vol").raise_for_status()
    http_a.delete("/v1/volumes/bench-vol").raise_for_status()
    out.update(volume_first_use_ms=statistics.median(first),
               volume_present_ms=statistics.median(present),
               volume_home_ms=statistics.median(home))
    return out


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0 or not (default_cache_dir() / "images/python").is_dir():
        print("needs root and the default image (python -m corral.runtime.prepare)")
        return 1
    rounds = bench_args.pick(args, 4, 2, 1)
    top = Path(tempfile.mkdtemp(prefix="corral-bench-travel-"))
    os.chmod(top, 0o711)
    ports = {"a": _port(), "b": _port()}
    peers = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    procs = []
    res: dict[str, float] = {}
    try:
        for n in ("a", "b"):
            (top / n).mkdir(mode=0o711)
            procs.append(_start(top / n, _cache(top / n, n == "b"), ports[n], peers))
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with corral.Client(peers["a"], token=TOKEN) as a, \
                corral.Client(peers["b"], token=TOKEN) as b, \
                httpx.Client(base_url=peers["a"], headers=auth, timeout=900) as http_a, \
                httpx.Client(base_url=peers["b"], headers=auth, timeout=900) as http_b:
            t = time.perf_counter()
            http_a.get("/v1/peer/images/python").raise_for_status()
            res["root_content_digest_ms"] = (time.perf_counter() - t) * 1000
            missing, present_root, present = [], [], []
            root_bytes = []
            for i in range(rounds):
                names = [f"bench-travel-{i}-{k}" for k in (1, 2)]
                for name in names:
                    _build(a, name)
                before = http_b.get("/v1/peer/stats").json()["bytes"]
                missing.append(_first_use(b, http_b, names[0]))
                root_bytes.append(http_b.get("/v1/peer/stats").json()["bytes"] - before)
                present_root.append(_first_use(b, http_b, names[1]))
                present.append(_first_use(b, http_b, names[0]))
                for name in names:
                    http_b.delete(f"/v1/images/{name}").raise_for_status()  # collects the root
                    http_a.delete(f"/v1/images/{name}").raise_for_status()
                left = [i["name"] for i in http_b.get("/v1/images").json()["images"]]
                assert not any(n.startswith("root-") for n in left), left
            res["first_use_root_missing_ms"] = statistics.median(missing)
            res["first_use_root_present_ms"] = statistics.median(present_root)
            res["present_ms"] = statistics.median(present)
            res["root_and_layers_mb"] = statistics.median(root_bytes) / 1e6
            res.update(_volumes(a, b, http_a, http_b, rounds,
                                bench_args.pick(args, 256, 64, 1), top))
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)  # stop (SIGTERM hands sandboxes over)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(top, ignore_errors=True)
    print(f"{rounds} rounds; medians")
    for key, value in res.items():
        print(f"{key:28} {value:10.1f}")
    print(f"a first use without the root takes {res['first_use_root_missing_ms'] / res['present_ms']:.1f}x "
          f"one with the image here ({res['root_and_layers_mb']:.0f} MB crossed, "
          f"{res['root_and_layers_mb'] / (res['first_use_root_missing_ms'] / 1000):.0f} MB/s); "
          f"with the root here, {res['first_use_root_present_ms'] / res['present_ms']:.1f}x")
    print(f"a volume's first use on another node takes "
          f"{res['volume_first_use_ms'] / res['volume_home_ms']:.1f}x one at its home "
          f"({res['volume_mb']:.0f} MiB crossed); with the copy there "
          f"{res['volume_present_ms'] / res['volume_home_ms']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
