"""The GPU check on real hardware: corral's engine gives sandboxes NVIDIA GPUs.

Run as root on a machine with an NVIDIA driver, after ``scripts/gpu_check.sh`` laid out
what it needs (it runs this with the machine's own Python 3.12 and PyTorch). Proves, and
times, in one run:

- the inventory through NVML, and the driver's files found through the ldconfig cache;
- a sandbox with ``gpus=1`` runs ``nvidia-smi`` and a CUDA matmul in PyTorch, on an image
  that is the machine's own root (read-only lower layer: its Python and PyTorch), and on
  corral's Debian ``python`` image (``nvidia-smi`` only: its Python has no PyTorch);
- a sandbox without ``gpus`` sees no GPU device and CUDA is unavailable in it;
- a second exclusive ``gpus=1`` sandbox is refused (``NoGpuCapacity``) while the GPUs
  are held, shared ones (``gpu_shared=True``) both see the GPU;
- create→ready with and without a GPU, and the matmul inside vs outside a sandbox.

Writes ``$OUT/gpu_check.json`` and prints a summary. Every step's failure is caught and
reported: one run says as much as it can.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/gpu-out"))
TORCH_PY = os.environ.get("TORCH_PY", "/opt/torch/.venv/bin/python")
MATMUL = """
import time, torch
assert torch.cuda.is_available(), "CUDA unavailable"
a = torch.randn(4096, 4096, device="cuda"); b = torch.randn(4096, 4096, device="cuda")
for _ in range(3): a @ b
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20): c = a @ b
torch.cuda.synchronize()
print(f"MATMUL_S={time.perf_counter() - t:.4f} DEVICE={torch.cuda.get_device_name(0)}"
      f" COUNT={torch.cuda.device_count()}")
"""
NO_GPU = "import torch; print('CUDA', torch.cuda.is_available(), torch.cuda.device_count())"
results: dict[str, object] = {}


def record(name: str, value: object) -> None:
    results[name] = value
    print(f"== {name}: {json.dumps(value, default=str)[:2000]}", flush=True)


async def step(name: str, coro) -> object:
    t = time.perf_counter()
    try:
        value = await coro
        record(name, {"ok": True, "value": value, "s": round(time.perf_counter() - t, 3)})
        return value
    except Exception as exc:  # report and go on: one run says as much as it can
        record(name, {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc()[-1500:]})
        return None


async def sh(engine, sid, cmd, timeout=300):
    return await run(engine, sid, ["sh", "-c", cmd], timeout)


async def run(engine, sid, argv, timeout=300):
    r = await engine.exec(sid, argv, timeout=timeout)
    return {"rc": r.returncode, "out": r.stdout.decode()[-3000:], "err": r.stderr.decode()[-3000:]}


async def create_ready_ms(engine, n, **spec):
    """create→ready with ``gpus=1`` and without, taking turns (drift hits both alike)."""
    times: dict[str, list[float]] = {"gpu": [], "cpu": []}
    for _ in range(n):
        for kind, extra in (("gpu", {"gpus": 1}), ("cpu", {})):
            t = time.perf_counter()
            info = await engine.create(**spec, **extra)
            times[kind].append((time.perf_counter() - t) * 1000)
            await engine.delete(info.id)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"gpu_median_ms": round(med["gpu"], 2), "cpu_median_ms": round(med["cpu"], 2),
            "ratio": round(med["gpu"] / med["cpu"], 3), "n": n}


async def main() -> int:
    from corral.errors import NoGpuCapacity
    from corral.runtime import doctor
    from corral.runtime.engine import Engine
    from corral.runtime.gpus import NvmlBackend

    backend = NvmlBackend()
    record("inventory", [vars(g) | {"node": str(g.node)} for g in backend.devices()])
    files = backend.driver_files()
    record("driver_files", {"version": files.version,
                            "libraries": [f"{s} <- {h}" for h, s in files.libraries],
                            "tools": [str(h) for h, _ in files.tools],
                            "control_nodes": [str(h) for h, _ in files.control_nodes]})
    record("doctor", doctor.gpus(backend).to_dict())
    outside = subprocess.run([TORCH_PY, "-c", MATMUL], capture_output=True, text=True, timeout=300)
    record("matmul_outside", outside.stdout.strip() or outside.stderr[-1500:])

    engine = await Engine.open(os.environ["CORRAL_STATE_DIR"], os.environ["CORRAL_CACHE_DIR"])
    big = {"memory_mb": 32768, "pids": 4096, "cpus": 8.0, "open_files": 16384}
    try:
        images = [i.name for i in engine.images.list()]
        record("images", images)
        for image in [i for i in ("hostroot", "python") if i in images]:
            gpu = await step(f"{image}_create_gpus1", engine.create(image=image, gpus=1, **big))
            if gpu is None:
                continue
            await step(f"{image}_gpu_dev_and_env", sh(
                engine, gpu.id, "ls -l /dev | grep nvidia; env | grep -E 'CUDA|NVIDIA|LD_LIB'; id"))
            await step(f"{image}_nvidia_smi", sh(engine, gpu.id, "nvidia-smi -L && nvidia-smi"))
            if image == "hostroot":
                for attempt in ("hostroot_matmul_inside", "hostroot_matmul_inside_again"):
                    await step(attempt, run(engine, gpu.id, [TORCH_PY, "-c", MATMUL]))
            await engine.delete(gpu.id)
            await step(f"{image}_second_exclusive_refused", _refused(engine, image, NoGpuCapacity))
            cpu = await step(f"{image}_create_no_gpu", engine.create(image=image, **big))
            if cpu is not None:
                await step(f"{image}_no_gpu_devices", sh(
                    engine, cpu.id, "ls /dev; ls /dev | grep -c nvidia; nvidia-smi 2>&1 | head -2"))
                if image == "hostroot":
                    await step("hostroot_no_gpu_cuda", run(engine, cpu.id, [TORCH_PY, "-c", NO_GPU]))
                await engine.delete(cpu.id)
            await step(f"{image}_shared", _shared(engine, image))
            await step(f"{image}_create_ready", create_ready_ms(engine, 15, image=image))
        await step("gpus_released", _released(engine))
    finally:
        await engine.close()
    (OUT / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


async def _refused(engine, image, err):
    held = await engine.create(image=image, gpus=1, memory_mb=256)
    try:
        await engine.create(image=image, gpus=1, memory_mb=256)
        return "NOT REFUSED"
    except err as exc:
        return {"refused": exc.code, "message": exc.message, "details": exc.details}
    finally:
        await engine.delete(held.id)


async def _shared(engine, image):
    a = await engine.create(image=image, gpus=1, gpu_shared=True, memory_mb=512)
    b = await engine.create(image=image, gpus=1, gpu_shared=True, memory_mb=512)
    try:
        out = [await sh(engine, s.id, "nvidia-smi -L") for s in (a, b)]
        return {"a": out[0], "b": out[1], "held": [engine.gpus.held_by(a.id), engine.gpus.held_by(b.id)]}
    finally:
        for s in (a, b):
            await engine.delete(s.id)


async def _released(engine):
    return {"free": engine.gpus.free(), "inventory": engine.gpus.describe()}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    sys.exit(asyncio.run(main()))
