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
REFERENCE = """
import torch, torch.nn as nn
class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(2048))
    def forward(self, a, b):
        return torch.relu(a @ b + self.bias) * self.scale
def get_inputs():
    return [torch.randn(2048, 2048), torch.randn(2048, 2048)]
def get_init_inputs():
    return [2.0]
"""
HEAD = """
import torch, torch.nn as nn
class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(2048))
"""
CANDIDATES = {
    "fast_tf32": HEAD + """
    def forward(self, a, b):
        torch.backends.cuda.matmul.allow_tf32 = True
        return torch.relu(torch.addmm(self.bias, a, b)) * self.scale
""",
    "same": HEAD + """
    def forward(self, a, b):
        return torch.clamp_min(torch.addmm(self.bias, a, b), 0) * self.scale
""",
    "slow": HEAD + """
    def forward(self, a, b):
        for _ in range(8):
            x = torch.relu(a @ b + self.bias) * self.scale
        return x
""",
    "triton": HEAD + """
    def forward(self, a, b):
        import triton, triton.language as tl
        @triton.jit
        def relu_scale(x_ptr, n, scale, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            x = tl.load(x_ptr + i, mask=m)
            tl.store(x_ptr + i, tl.maximum(x, 0.0) * scale, mask=m)
        y = torch.addmm(self.bias, a, b)
        relu_scale[(triton.cdiv(y.numel(), 1024),)](y, y.numel(), self.scale, BLOCK=1024)
        return y
""",
    "fused": HEAD + """
    def forward(self, a, b):
        return torch.addmm(self.bias, a, b).relu_().mul_(self.scale)
""",
    "wrong": HEAD + """
    def forward(self, a, b):
        return (a @ b + self.bias) * self.scale
""",
    "hack_cache": HEAD + """
    cache = None
    def forward(self, a, b):
        if ModelNew.cache is None:
            ModelNew.cache = torch.relu(a @ b + self.bias) * self.scale
        return ModelNew.cache
""",
    "hack_skip_timed": HEAD + """
    calls = 0
    def forward(self, a, b):
        ModelNew.calls += 1
        if ModelNew.calls > 3:
            return torch.zeros(2048, 2048, device=a.device)
        return torch.relu(a @ b + self.bias) * self.scale
""",
    "hack_other_stream": HEAD + """
    def forward(self, a, b):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = torch.relu(a @ b + self.bias) * self.scale
        return y
""",
    # computes each timed set while it is staged (untimed), keyed by content; staged
    # masked, what it computes from is noise: expect "ok", a speedup near "same"'s or
    # below (its key costs), never far above
    "hack_precompute_staging": HEAD + """
    memo, pending, me = {}, [], None
    def forward(self, a, b):
        ModelNew.me = self
        hit = ModelNew.memo.get((a.double().sum().item(), b.double().sum().item()))
        return hit if hit is not None else torch.relu(a @ b + self.bias) * self.scale
_to = torch.Tensor.to
def to(t, *args, **kw):
    import sys
    out = _to(t, *args, **kw)
    f = sys._getframe()
    while f is not None and f.f_code.co_name != "worker":
        f = f.f_back
    if f is None or f.f_locals.get("op") != "stage" or ModelNew.me is None:
        return out
    ModelNew.pending.append(out)
    if len(ModelNew.pending) == 2:
        try:
            a, b = (x if x.dtype == torch.float32 else x.view(torch.float32).reshape(2048, 2048)
                    for x in ModelNew.pending)
            m = ModelNew.me
            with torch.no_grad():
                ModelNew.memo[(a.double().sum().item(), b.double().sum().item())] = (
                    torch.relu(a @ b + m.bias) * m.scale)
        except Exception:
            pass
        ModelNew.pending = []
    return out
torch.Tensor.to = to
""",
    "hack_read_judge": HEAD + """
    def forward(self, a, b):
        import os
        judge, got = os.getppid(), []
        for what in ("fd/1", "mem", "environ", "fd/0"):
            try:
                with open(f"/proc/{judge}/{what}", "wb" if what == "fd/1" else "rb") as f:
                    if what == "fd/1":
                        f.write(b'{"correct": true, "speedup": 1000.0, "status": "ok"}\\n')
                    else:
                        f.read(4096)
                got.append(what)
            except OSError:
                pass
        raise SystemExit(f"reached {got}")
""",
    "hack_kill_judge": HEAD + """
    def forward(self, a, b):
        import os, signal
        os.kill(os.getppid(), signal.SIGKILL)
""",
}
results: dict[str, object] = {}
# PyTorch's environment (TORCH_PY's venv: /opt/torch/.venv/bin/python → /opt/torch) bound
# read-only into hostroot sandboxes by the admin: an overlay's lower layer does not show
# the mounts under it, and /opt may be one
TORCH_HOME = str(Path(TORCH_PY).parents[2])


def mounts(image: str) -> dict:
    if image != "hostroot" or not os.path.isdir(TORCH_HOME):
        return {}
    return {"volumes": {TORCH_HOME: f"{TORCH_HOME}:ro"}}


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
            info = await engine.create(**spec, **extra, **mounts(spec["image"]))
            times[kind].append((time.perf_counter() - t) * 1000)
            await engine.delete(info.id)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"gpu_median_ms": round(med["gpu"], 2), "cpu_median_ms": round(med["cpu"], 2),
            "ratio": round(med["gpu"] / med["cpu"], 3), "n": n}


HOLD = ("import torch, time; x = torch.empty(1 << 28, device='cuda'); "
        "torch.cuda.synchronize(); time.sleep(60)")  # 1 GiB of float32


async def _usage_holding(engine, sid):
    """sb.info's usage while a process of the sandbox holds 1 GiB of GPU memory."""
    await sh(engine, sid, f"nohup {TORCH_PY} -c \"{HOLD}\" >/tmp/hold.log 2>&1 &")
    seen = []
    for _ in range(25):
        await asyncio.sleep(1)
        usage = engine.usage(sid)
        seen.append(usage)
        if (usage.get("gpu_memory_mb") or 0) >= 1024:
            break
    await sh(engine, sid, "pkill -f 'torch.empty' || true")
    return {"last": seen[-1], "polls": len(seen)}


async def _device_rules(engine, sid):
    """The device cgroup's list for a GPU sandbox (v1), or the v2 program's presence."""
    dirs = engine.cgroup(sid)._dirs
    if "devices" in dirs:
        return (dirs["devices"] / "devices.list").read_text().split("\n")
    return {"v2": str(dirs.get(""))}


async def main() -> int:
    from corral.errors import NoGpuCapacity
    from corral.runtime import doctor
    from corral.runtime.engine import Engine
    from corral.runtime.gpus import NvmlBackend

    try:
        backend = NvmlBackend()
        record("inventory", [vars(g) | {"node": str(g.node)} for g in backend.devices()])
        files = backend.driver_files()
        record("driver_files", {"version": files.version,
                                "libraries": [f"{s} <- {h}" for h, s in files.libraries],
                                "tools": [str(h) for h, _ in files.tools],
                                "control_nodes": [str(h) for h, _ in files.control_nodes]})
        record("doctor", doctor.gpus(backend).to_dict())
    except Exception as exc:  # go on: the sandbox steps say what they can
        record("inventory", {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "trace": traceback.format_exc()[-1500:]})
    outside = subprocess.run([TORCH_PY, "-c", MATMUL], capture_output=True, text=True, timeout=300)
    record("matmul_outside", outside.stdout.strip() or outside.stderr[-1500:])

    engine = await Engine.open(os.environ["CORRAL_STATE_DIR"], os.environ["CORRAL_CACHE_DIR"])
    big = {"memory_mb": 32768, "pids": 4096, "cpus": 8.0, "open_files": 16384}
    try:
        images = [i.name for i in engine.images.list()]
        record("images", images)
        if os.environ.get("KERNELS"):  # a second run: only these candidates
            await step("kernel_rewards", _kernels(engine, "hostroot",
                                                  os.environ["KERNELS"].split(",")))
            images = []
        for image in [i for i in ("hostroot", "python") if i in images]:
            gpu = await step(f"{image}_create_gpus1", engine.create(
                image=image, gpus=1, **big, **mounts(image)))
            if gpu is not None:  # else the steps without a GPU still run
                await step(f"{image}_gpu_dev_and_env", sh(
                    engine, gpu.id, "ls -l /dev | grep nvidia; env | grep -E 'CUDA|NVIDIA|LD_LIB'; id"))
                await step(f"{image}_nvidia_smi", sh(engine, gpu.id, "nvidia-smi -L && nvidia-smi"))
                if image == "hostroot":
                    for attempt in ("hostroot_matmul_inside", "hostroot_matmul_inside_again"):
                        await step(attempt, run(engine, gpu.id, [TORCH_PY, "-c", MATMUL]))
                    await step("hostroot_usage_while_holding", _usage_holding(engine, gpu.id))
                await step(f"{image}_device_cgroup", _device_rules(engine, gpu.id))
                await engine.delete(gpu.id)
            if gpu is not None:
                await step(f"{image}_second_exclusive_refused",
                           _refused(engine, image, NoGpuCapacity))
            cpu = await step(f"{image}_create_no_gpu", engine.create(
                image=image, **big, **mounts(image)))
            if cpu is not None:
                await step(f"{image}_no_gpu_devices", sh(
                    engine, cpu.id, "ls /dev; ls /dev | grep -c nvidia; nvidia-smi 2>&1 | head -2; "
                    f"ls -d {TORCH_HOME}/* | head -3"))
                if image == "hostroot":
                    await step("hostroot_no_gpu_cuda", run(engine, cpu.id, [TORCH_PY, "-c", NO_GPU]))
                await engine.delete(cpu.id)
            if gpu is not None:
                await step(f"{image}_shared", _shared(engine, image))
            await step(f"{image}_create_ready", create_ready_ms(engine, 15, image=image))
            if image == "hostroot" and gpu is not None:
                await step("kernel_rewards", _kernels(engine, image))
        await step("gpus_released", _released(engine))
    finally:
        await engine.close()
    (OUT / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


async def _refused(engine, image, err):
    held = await engine.create(image=image, gpus=1, memory_mb=256, **mounts(image))
    try:
        await engine.create(image=image, gpus=1, memory_mb=256, **mounts(image))
        return "NOT REFUSED"
    except err as exc:
        return {"refused": exc.code, "message": exc.message, "details": exc.details}
    finally:
        await engine.delete(held.id)


async def _shared(engine, image):
    a = await engine.create(image=image, gpus=1, gpu_shared=True, memory_mb=512, **mounts(image))
    b = await engine.create(image=image, gpus=1, gpu_shared=True, memory_mb=512, **mounts(image))
    try:
        out = [await sh(engine, s.id, "nvidia-smi -L") for s in (a, b)]
        return {"a": out[0], "b": out[1], "held": [engine.gpus.held_by(a.id), engine.gpus.held_by(b.id)]}
    finally:
        for s in (a, b):
            await engine.delete(s.id)


async def _kernels(engine, image, only=None):
    """corral.rl.kernel's judge in a GPU sandbox, as kernel_reward runs it (through the
    engine here: no daemon on this machine), for honest candidates and hacks; and the
    same judge run unsandboxed on the host for its overhead."""
    from corral.rl.kernel import kernel_payload, outcome, parse_verdict

    out = {}
    for name, source in CANDIDATES.items():
        if only and name not in only:
            continue
        payload = kernel_payload(source, REFERENCE, device="cuda", trials=3, timing_inputs=4,
                                 repeats=10, timeout=90)
        t = time.perf_counter()
        sb = await engine.create(image=image, gpus=1, memory_mb=32768, pids=1024,
                                 open_files=4096, **mounts(image))
        try:
            r = await engine.exec(sb.id, [TORCH_PY, "-I", "-c", payload["program"]],
                                  stdin=json.dumps(payload), timeout=120)
        finally:
            await engine.delete(sb.id)
        o = outcome(parse_verdict(r.stdout), max_speedup=10.0, stderr=r.stderr)
        out[name] = {"reward": o.reward, "status": o.status, "speedup": o.speedup,
                     "reason": (o.reason or "")[:300], "ref_ms": o.reference_ms,
                     "cand_ms": o.candidate_ms, "wall_s": round(time.perf_counter() - t, 2),
                     "stderr": r.stderr.decode(errors="replace")[-400:]}
        print(f"   kernel {name}: {out[name]}", flush=True)
    for name in (only or ("same", "fast_tf32"))[:2]:  # the judge's overhead: the same check, unsandboxed
        payload = kernel_payload(CANDIDATES[name], REFERENCE, device="cuda", trials=3,
                                 timing_inputs=4, repeats=10, timeout=240)
        t = time.perf_counter()
        p = subprocess.run([TORCH_PY, "-I", "-c", payload["program"]], input=json.dumps(payload),
                           capture_output=True, text=True, timeout=600)
        o = outcome(parse_verdict(p.stdout), max_speedup=10.0, stderr=p.stderr)
        out[f"unsandboxed_{name}"] = {"reward": o.reward, "status": o.status,
                                      "speedup": o.speedup, "wall_s": round(time.perf_counter() - t, 2)}
    return out


async def _released(engine):
    return {"free": engine.gpus.free(), "inventory": engine.gpus.describe()}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    sys.exit(asyncio.run(main()))
