"""The kernel judge: is a candidate kernel right, and how fast is it against a reference?

Runs inside a (GPU) sandbox as ``python3 -I -c <this file> judge``; reads one JSON
payload on stdin (the reference's and the candidate's sources in KernelBench's shape —
``Model``/``get_inputs``/``get_init_inputs`` and ``ModelNew`` — the seeds, the
tolerances, the device), prints one JSON verdict as its last stdout line. It imports
PyTorch from the image, nothing of corral.

Who can touch what (the candidate is written by a model optimised to earn reward):

- The judge never runs candidate code. It starts the **reference worker** first and
  takes from it everything it needs — the inputs of every trial (from seeds the
  candidate never sees), the reference outputs, the digests of the timed runs and the
  reference's times — and that worker has exited before the **candidate worker**
  starts: nothing of the reference is alive for the candidate to read or disturb.
- The judge is not dumpable (``PR_SET_DUMPABLE`` 0): a process of the same uid can
  neither ptrace it nor read its ``/proc/PID/mem``, ``fd`` or ``environ``. The
  candidate worker gets only two pipes to the judge; the judge's stdout (the verdict)
  is not among its descriptors.
- Each model is compiled from a file of its own (:func:`source_module`), readable by
  the candidate (one uid): the reference's is removed with its worker, before the
  candidate starts, and the input maker's once it is compiled — no file of the
  reference's source is left while the candidate runs (nor after the judge).
- What the candidate sends back is parsed without pickle (a JSON header, raw bytes of an
  allow-listed dtype, sizes checked against the reference's outputs).
- The judge's clock times the candidate: a "time" request is answered only after the
  worker ran every staged input set and synchronised, and the answer carries digests
  (sum, sum of squares, max |x|, float64) of every output, checked against the
  reference's — work skipped, cached across inputs or left running on another stream
  shows as a wrong digest; a timer patched in the worker measures nothing the judge uses.
- The timed inputs are staged (sent, moved to the device: not timed) *masked*: each
  tensor's bytes XORed with a mask the input maker drew on the device from a seed
  the worker is given only in the "time" request. The worker unmasks them on the clock;
  while staging, what it holds is noise, so nothing can be computed ahead of the clock
  (in a wrapped ``Tensor.to``, a patched ``synchronize``, a thread).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import secrets
import select
import signal
import statistics
import struct
import subprocess
import sys
import time

MAX_HEADER = 1 << 20
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
          "uint8", "bool")


# ------------------------------------------------------------------ the wire
# A message: 4-byte big-endian length, a JSON header; the header's "tensors" list
# descriptors ({"dtype", "shape", "nbytes"} or {"py": scalar}) whose raw bytes follow.


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("no answer in time")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the worker ended")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(fd: int, deadline: float, max_bytes: int) -> tuple[dict, list[bytes]]:
    (n,) = struct.unpack(">I", _read_exact(fd, 4, deadline))
    if n > MAX_HEADER:
        raise ValueError(f"header of {n} bytes")
    header = json.loads(_read_exact(fd, n, deadline))
    blobs, total = [], 0
    for d in header.get("tensors", []):
        if "py" in d:
            continue
        size = int(d["nbytes"])
        total += size
        if size < 0 or total > max_bytes:
            raise ValueError(f"message over {max_bytes} bytes")
        blobs.append(_read_exact(fd, size, deadline))
    return header, blobs


def send(fd: int, header: dict, blobs: list[bytes] = ()) -> None:
    data = json.dumps(header).encode()
    os.write(fd, struct.pack(">I", len(data)) + data)
    for b in blobs:
        view = memoryview(b)
        while view:
            view = view[os.write(fd, view):]


# ------------------------------------------------------------------ the workers


def mask_of(torch, seed: int, nbytes: int, device: str):
    """The bytes a staged tensor of ``nbytes`` is XORed with: drawn on ``device`` from
    ``seed`` (the same bytes in every process on that kind of device)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def source_module(role: str, source: str) -> tuple[dict, str]:
    """A fresh module namespace for ``source`` and the file it is compiled from: its
    own file in a private directory (Triton's ``@jit`` and ``inspect.getsource`` read a
    function's source back from its file), also put in ``linecache``."""
    import linecache
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix=f"corral-{role}-"), f"{role}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    return {"__name__": f"corral_{role}", "__file__": path}, path


def _remove_source(role: str, path: str) -> None:
    """Remove ``role``'s source file and its private directory (made by
    :func:`source_module`; a path a worker's reply names is checked to be one)."""
    import shutil
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    if (os.path.dirname(folder) == tempfile.gettempdir()
            and os.path.basename(folder).startswith(f"corral-{role}-")):
        shutil.rmtree(folder, ignore_errors=True)


def worker(role: str) -> None:  # pragma: no cover - runs in its own process
    """A model's process: loads its source, answers load/inputs/run/stage/time."""
    if role != "candidate":
        _undumpable()
    import torch

    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr  # prints of the model go to stderr, never onto the wire
    model, module, device, staged = None, {}, "cpu", []

    def pack(values):
        descs, blobs = [], []
        for v in values if isinstance(values, (list, tuple)) else [values]:
            if isinstance(v, torch.Tensor):
                t = v.detach().to("cpu").contiguous()
                raw = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
                descs.append({"dtype": str(t.dtype).removeprefix("torch."),
                              "shape": list(t.shape), "nbytes": len(raw)})
                blobs.append(raw)
            else:
                descs.append({"py": v})
        return descs, blobs

    def unpack(header, blobs):
        out, it = [], iter(blobs)
        for d in header["tensors"]:
            if "py" in d:
                out.append(d["py"])
                continue
            t = tensor_from(torch, d, next(it))
            out.append(t.to(device))
        return out

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    while True:
        try:
            header, blobs = recv(rfd, time.monotonic() + 86400, 1 << 40)
        except EOFError:
            return
        op = header["op"]
        try:
            if op == "load":
                device = header["device"]
                module, path = source_module(role, header["source"])
                exec(compile(header["source"], path, "exec"), module)  # noqa: S102
                if role == "inputs":  # it runs while the candidate does: no file left
                    _remove_source(role, path)  # (its lines stay in linecache)
                init = header.get("init")
                if init is None:
                    init = list(module["get_init_inputs"]())
                if role != "inputs":  # the input maker runs get_inputs only
                    torch.manual_seed(header["init_seed"])
                    cls = module["Model" if role == "reference" else "ModelNew"]
                    model = cls(*init).to(device).eval()
                send(wfd, {"ok": True, "init": init, "source_dir": os.path.dirname(path)})
            elif op == "inputs":
                torch.manual_seed(header["seed"])
                descs, raw = pack(list(module["get_inputs"]()))
                if header.get("mask") is not None:  # for staging: masked (see mask_of)
                    for i, d in enumerate(d for d in descs if "py" not in d):
                        raw[i] = masked(torch, raw[i], header["mask"] + i, header["mask_device"])
                        d["masked"] = True
                send(wfd, {"ok": True, "tensors": descs}, raw)
            elif op == "run":
                with torch.no_grad():
                    out = model(*unpack(header, blobs))
                sync()
                descs, raw = pack(out)
                send(wfd, {"ok": True, "tensors": descs}, raw)
            elif op == "stage":  # masked bytes on the device, no tensor made of them yet
                if header.get("reset"):
                    staged.clear()
                it = iter(blobs)
                staged.append([
                    (d, d["py"]) if "py" in d else (d, tensor_from(
                        torch, {"dtype": "uint8", "shape": [d["nbytes"]], "nbytes": d["nbytes"]},
                        next(it)).to(device)) for d in header["tensors"]])
                sync()
                send(wfd, {"ok": True})
            elif op == "time":  # on the judge's clock: unmask, run, digest
                sync()
                with torch.no_grad():
                    outs = [model(*unmask(torch, inputs, seed, device))
                            for inputs, seed in zip(staged, header["masks"], strict=True)]
                digests = [digest(torch, o) for o in outs]
                sync()
                send(wfd, {"ok": True, "digests": [[float(x) for x in d] for d in digests]})
        except Exception as exc:  # the judge decides what it means
            send(wfd, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})


def dtype_of(torch, name: str):
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not accepted")
    return getattr(torch, name)


def masked(torch, raw: bytes, seed: int, device: str) -> bytes:
    """``raw`` XORed with :func:`mask_of` ``seed`` (drawn on ``device``, used here)."""
    if not raw:
        return raw
    plain = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = (plain ^ mask_of(torch, seed, len(raw), device).cpu()).contiguous()
    return ctypes.string_at(out.data_ptr(), out.numel())


def unmask(torch, staged: list, seed: int, device: str) -> list:
    """A staged input set (``(descriptor, masked bytes on the device | scalar)``) as the
    model's arguments: each tensor's bytes XORed with its mask again (:func:`mask_of`,
    ``seed`` + its place), viewed as its dtype and shape."""
    out, i = [], 0
    for d, v in staged:
        if "py" in d:
            out.append(v)
            continue
        plain = v ^ mask_of(torch, seed + i, v.numel(), device) if d.get("masked") else v
        out.append(plain.view(dtype_of(torch, d["dtype"])).reshape([int(s) for s in d["shape"]]))
        i += 1
    return out


def tensor_from(torch, desc: dict, raw: bytes):
    dtype = dtype_of(torch, desc["dtype"])
    shape = [int(s) for s in desc["shape"]]
    if len(shape) > 16 or any(s < 0 for s in shape):
        raise ValueError("bad shape")
    if math.prod(shape) * torch.empty(0, dtype=dtype).element_size() != len(raw):
        raise ValueError(f"shape {shape} {desc['dtype']} does not match {len(raw)} bytes")
    t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(shape)


def digest(torch, out):
    """sum, sum of squares, max |x|, sum |x| and size of every output tensor, in float64,
    on device."""
    parts = out if isinstance(out, (list, tuple)) else [out]
    vals = []
    for t in parts:
        if isinstance(t, torch.Tensor):
            d = t.detach().to(torch.float64)
            n = torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device)
            vals += [d.sum(), (d * d).sum(), d.abs().max() if d.numel() else d.sum(),
                     d.abs().sum(), n]
    return torch.stack(vals).tolist() if vals else []


def _undumpable() -> None:
    """PR_SET_DUMPABLE 0: no ptrace, no /proc/PID/mem|fd|environ for same-uid processes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")


# ------------------------------------------------------------------ the judge


class Worker:
    """One model's process, spoken to through two pipes, in a session of its own."""

    def __init__(self, role: str, me: str, timeout: float) -> None:
        self.role = role
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", me, "worker", role], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
            start_new_session=True)
        self.started = time.monotonic()
        self.source_dir: str | None = None  # its model's file's directory (source_module)

    def call(self, header: dict, blobs: list[bytes] = (), *, max_bytes: int = 1 << 34):
        send(self.proc.stdin.fileno(), header, blobs)
        reply, data = recv(self.proc.stdout.fileno(), self.started + self.timeout, max_bytes)
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "error"))
        return reply, data

    def timed(self, masks: list[int]) -> tuple[float, list]:
        """Run the staged sets (unmasked with ``masks``, see :func:`stage`) on the
        judge's clock: the time and the outputs' digests."""
        t = time.perf_counter()
        reply, _ = self.call({"op": "time", "masks": masks})
        return time.perf_counter() - t, reply["digests"]

    def stderr_tail(self) -> str:
        try:
            if select.select([self.proc.stderr], [], [], 0)[0]:
                return os.read(self.proc.stderr.fileno(), 1 << 16).decode(errors="replace")[-1500:]
        except OSError:
            pass
        return ""

    def end(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        if self.source_dir:  # the reference's file is gone before the candidate starts
            _remove_source(self.role, os.path.join(self.source_dir, f"{self.role}.py"))


class WorkerError(Exception):
    pass


def close(a: list, b: list, atol: float, rtol: float) -> str | None:
    """Why candidate outputs ``b`` (descriptor, tensor) differ from reference ``a``."""
    import torch

    if len(a) != len(b):
        return f"{len(b)} outputs, expected {len(a)}"
    for i, ((da, ta), (db, tb)) in enumerate(zip(a, b, strict=True)):
        if da.get("shape") != db.get("shape") or da.get("dtype") != db.get("dtype"):
            return (f"output {i}: shape {db.get('shape')} {db.get('dtype')}, expected "
                    f"{da.get('shape')} {da.get('dtype')}")
        if ta is None:
            if da.get("py") != db.get("py"):
                return f"output {i}: {db.get('py')!r}, expected {da.get('py')!r}"
            continue
        if not torch.allclose(tb.double(), ta.double(), atol=atol, rtol=rtol, equal_nan=True):
            worst = (tb.double() - ta.double()).abs().max().item()
            return f"output {i}: values differ (max abs diff {worst:.3g})"
    return None


def digests_match(ref: list, cand: list, atol: float, rtol: float) -> bool:
    """Whether ``cand``'s digests are those of outputs each within ``atol + rtol*|ref|``
    of the reference's (what the correctness trials check element by element). The
    bounds are that tolerance summed over the elements, no looser: a loose one let
    outputs with a quarter of their rows copied from the others pass."""
    if len(ref) != len(cand):
        return False
    for r, c in zip(ref, cand, strict=True):
        if len(r) != len(c) or len(r) % 5:
            return False
        for i in range(0, len(r), 5):
            s, q, m, a, n = r[i:i + 5]
            if c[i + 4] != n:
                return False
            slack = a * atol + q * rtol  # sum d|r| over elements, d = atol + rtol|r|
            bounds = (n * atol + rtol * a,  # sum
                      2 * slack + n * atol * atol + 2 * atol * rtol * a + rtol * rtol * q,
                      atol + rtol * m,  # max |x|
                      n * atol + rtol * a)  # sum |x|
            for x, y, bound in zip((s, q, m, a), c[i:i + 4], bounds, strict=True):
                if not math.isfinite(x):
                    if not (x == y or (math.isnan(x) and math.isnan(y))):
                        return False
                    continue
                if not abs(x - y) <= bound + 1e-6 * max(1.0, abs(x)):
                    return False
    return True


def stage(source: Worker, to: Worker, seeds: list, device: str) -> list[int]:
    """Stage in ``to`` the input sets ``source`` makes from ``seeds``, replacing the last,
    each masked with a mask of its own drawn on ``device``: the mask seeds, which ``to``
    is given only in the timed request (:meth:`Worker.timed`)."""
    masks = [secrets.randbits(62) for _ in seeds]
    for i, (seed, mask) in enumerate(zip(seeds, masks, strict=True)):
        r, data = source.call({"op": "inputs", "seed": seed, "mask": mask,
                               "mask_device": device})
        to.call({"op": "stage", "tensors": r["tensors"], "reset": i == 0}, data)
    return masks


def judge(payload: dict, me: str) -> dict:
    import torch

    trials, runs, repeats = payload["trials"], payload["timing_inputs"], payload["repeats"]
    atol, rtol, device = payload["atol"], payload["rtol"], payload["device"]
    timeout = payload["timeout"]
    verdict: dict = {"correct": False, "speedup": None, "status": "ok", "reason": None}

    def described(reply, data):
        out, it = [], iter(data)
        for d in reply["tensors"]:
            out.append((d, None if "py" in d else tensor_from(torch, d, next(it))))
        return out

    # phase A: the reference, alone
    ref = Worker("reference", me, timeout)
    try:
        reply, _ = ref.call({"op": "load", "source": payload["reference"], "device": device,
                             "init_seed": payload["init_seed"]})
        init = reply["init"]
        ref.source_dir = reply.get("source_dir")
        inputs, expected = [], []
        for seed in payload["seeds"][:trials]:
            r, data = ref.call({"op": "inputs", "seed": seed})
            inputs.append((r, data))
        for r, data in inputs:
            out_r, out_d = ref.call({"op": "run", "tensors": r["tensors"]}, data)
            expected.append(described(out_r, out_d))
        # The warm-up and each timed repeat on input sets of their own: the same sets
        # again would let a candidate answer every repeat from a memo of the first.
        rounds = [payload["seeds"][trials + k * runs:trials + (k + 1) * runs]
                  for k in range(repeats + 1)]
        ref_times, ref_digests = [], []
        for k, seeds in enumerate(rounds):
            took, digests = ref.timed(stage(ref, ref, seeds, device))
            ref_digests.append(digests)
            if k:
                ref_times.append(took)
    except (WorkerError, TimeoutError, EOFError, KeyError, ValueError) as exc:
        return {**verdict, "status": "reference_error",
                "reason": f"the reference failed: {exc}; {ref.stderr_tail()}".strip()}
    finally:
        ref.end()
    verdict["reference_ms"] = statistics.median(ref_times) * 1000

    # phase B: the candidate, given only inputs (the marker tells the host that a judge
    # which dies from now on was ended by the candidate: corral.rl.kernel.outcome)
    # The timed rounds' inputs are made again, round by round, by a process that runs
    # only the reference's get_inputs (holding every round's inputs at once would not fit).
    maker = Worker("inputs", me, timeout)
    try:
        maker.call({"op": "load", "source": payload["reference"], "device": "cpu",
                    "init_seed": payload["init_seed"], "init": init})
    except (WorkerError, TimeoutError, EOFError) as exc:
        maker.end()
        return {**verdict, "status": "reference_error",
                "reason": f"the reference's inputs failed: {exc}"}
    sys.stderr.write("corral-kernel-judge: candidate started\n")
    sys.stderr.flush()
    cand = Worker("candidate", me, timeout)
    try:
        try:
            reply, _ = cand.call({"op": "load", "source": payload["candidate"],
                                  "device": device, "init_seed": payload["init_seed"],
                                  "init": init})
            cand.source_dir = reply.get("source_dir")
        except (WorkerError, EOFError) as exc:
            return {**verdict, "status": "compile_error", "reason": str(exc)[:2000]}
        for i, (r, data) in enumerate(inputs[:trials]):
            limit = sum(int(d.get("nbytes", 0)) for d, _ in expected[i]) + 1024
            out_r, out_d = cand.call({"op": "run", "tensors": r["tensors"]}, data, max_bytes=limit)
            why = close(expected[i], described(out_r, out_d), atol, rtol)
            if why:
                return {**verdict, "status": "wrong", "reason": f"trial {i}: {why}"}
        times = []
        for k, seeds in enumerate(rounds):  # the warm-up (round 0) is checked too
            took, digests = cand.timed(stage(maker, cand, seeds, device))
            if not digests_match(ref_digests[k], digests, atol, rtol):
                return {**verdict, "status": "wrong",
                        "reason": "the timed runs' outputs differ from the reference's "
                                  "(work skipped, cached or left unfinished?)"}
            if k:
                times.append(took)
    except TimeoutError:
        return {**verdict, "status": "timeout", "reason": f"over {timeout:g} s"}
    except (WorkerError, EOFError, KeyError, ValueError, TypeError, AttributeError,
            IndexError, RuntimeError) as exc:  # what the candidate sent did not parse: its 0
        return {**verdict, "status": "runtime_error",
                "reason": f"{exc}; {cand.stderr_tail()}".strip()[:2000]}
    finally:
        cand.end()
        maker.end()
    cand_ms = statistics.median(times) * 1000
    return {**verdict, "correct": True, "candidate_ms": cand_ms,
            "speedup": verdict["reference_ms"] / cand_ms if cand_ms > 0 else None}


def main() -> None:
    """``judge`` (the default): a payload on stdin, a verdict on stdout. ``worker ROLE``:
    a model's process (the judge starts it with this same program, sent in the payload)."""
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
        return
    _undumpable()
    payload = json.loads(sys.stdin.read())
    try:
        verdict = judge(payload, payload["program"])
    except Exception as exc:  # a judge bug is not the candidate's fault: say so
        verdict = {"correct": False, "speedup": None, "status": "judge_error",
                   "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    sys.stdout.write(json.dumps(verdict) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
