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
- What the candidate sends back is parsed without pickle (a JSON header, raw bytes of an
  allow-listed dtype, sizes checked against the reference's outputs).
- The judge's clock times the candidate: a "time" request is answered only after the
  worker ran every staged input set and synchronised, and the answer carries digests
  (sum, sum of squares, max |x|, float64) of every output, checked against the
  reference's — work skipped, cached across inputs or left running on another stream
  shows as a wrong digest; a timer patched in the worker measures nothing the judge uses.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
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


def worker(role: str) -> None:  # pragma: no cover - runs in its own process
    """A model's process: loads its source, answers load/inputs/run/stage/time."""
    if role == "reference":
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
                exec(compile(header["source"], f"<{role}>", "exec"), module)  # noqa: S102
                init = header.get("init")
                if init is None:
                    init = list(module["get_init_inputs"]())
                torch.manual_seed(header["init_seed"])
                cls = module["Model" if role == "reference" else "ModelNew"]
                model = cls(*init).to(device).eval()
                send(wfd, {"ok": True, "init": init})
            elif op == "inputs":
                torch.manual_seed(header["seed"])
                descs, raw = pack(list(module["get_inputs"]()))
                send(wfd, {"ok": True, "tensors": descs}, raw)
            elif op == "run":
                with torch.no_grad():
                    out = model(*unpack(header, blobs))
                sync()
                descs, raw = pack(out)
                send(wfd, {"ok": True, "tensors": descs}, raw)
            elif op == "stage":
                staged.append(unpack(header, blobs))
                sync()
                send(wfd, {"ok": True})
            elif op == "time":
                sync()
                with torch.no_grad():
                    outs = [model(*inputs) for inputs in staged]
                digests = [digest(torch, o) for o in outs]
                sync()
                send(wfd, {"ok": True, "digests": [[float(x) for x in d] for d in digests]})
        except Exception as exc:  # the judge decides what it means
            send(wfd, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})


def tensor_from(torch, desc: dict, raw: bytes):
    if desc["dtype"] not in DTYPES:
        raise ValueError(f"dtype {desc['dtype']!r} is not accepted")
    dtype = getattr(torch, desc["dtype"])
    shape = [int(s) for s in desc["shape"]]
    if len(shape) > 16 or any(s < 0 for s in shape):
        raise ValueError("bad shape")
    t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(shape)


def digest(torch, out):
    """sum, sum of squares and max |x| of every output tensor, in float64, on device."""
    parts = out if isinstance(out, (list, tuple)) else [out]
    vals = []
    for t in parts:
        if isinstance(t, torch.Tensor):
            d = t.detach().to(torch.float64)
            vals += [d.sum(), (d * d).sum(), d.abs().max() if d.numel() else d.sum()]
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

    def call(self, header: dict, blobs: list[bytes] = (), *, max_bytes: int = 1 << 34):
        send(self.proc.stdin.fileno(), header, blobs)
        reply, data = recv(self.proc.stdout.fileno(), self.started + self.timeout, max_bytes)
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "error"))
        return reply, data

    def timed(self) -> tuple[float, list]:
        t = time.perf_counter()
        reply, _ = self.call({"op": "time"})
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
    if len(ref) != len(cand):
        return False
    for r, c in zip(ref, cand, strict=True):
        if len(r) != len(c):
            return False
        for x, y in zip(r, c, strict=True):
            if not (math.isfinite(y) or not math.isfinite(x)):
                return False
            if abs(x - y) > atol * 1e3 + rtol * 10 * abs(x) + 1e-6 * max(1.0, abs(x)):
                return False
    return True


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
        inputs, expected = [], []
        for seed in payload["seeds"][:trials + runs]:
            r, data = ref.call({"op": "inputs", "seed": seed})
            inputs.append((r, data))
        for r, data in inputs[:trials]:
            out_r, out_d = ref.call({"op": "run", "tensors": r["tensors"]}, data)
            expected.append(described(out_r, out_d))
        for r, data in inputs[trials:]:
            ref.call({"op": "stage", "tensors": r["tensors"]}, data)
        ref.timed()  # warm-up
        ref_times, ref_digests = [], None
        for _ in range(repeats):
            took, ref_digests = ref.timed()
            ref_times.append(took)
    except (WorkerError, TimeoutError, EOFError, KeyError, ValueError) as exc:
        return {**verdict, "status": "reference_error",
                "reason": f"the reference failed: {exc}; {ref.stderr_tail()}".strip()}
    finally:
        ref.end()
    verdict["reference_ms"] = statistics.median(ref_times) * 1000

    # phase B: the candidate, given only inputs (the marker tells the host that a judge
    # which dies from now on was ended by the candidate: corral.rl.kernel.outcome)
    sys.stderr.write("corral-kernel-judge: candidate started\n")
    sys.stderr.flush()
    cand = Worker("candidate", me, timeout)
    try:
        try:
            cand.call({"op": "load", "source": payload["candidate"], "device": device,
                       "init_seed": payload["init_seed"], "init": init})
        except (WorkerError, EOFError) as exc:
            return {**verdict, "status": "compile_error", "reason": str(exc)[:2000]}
        for i, (r, data) in enumerate(inputs[:trials]):
            limit = sum(int(d.get("nbytes", 0)) for d, _ in expected[i]) + 1024
            out_r, out_d = cand.call({"op": "run", "tensors": r["tensors"]}, data, max_bytes=limit)
            why = close(expected[i], described(out_r, out_d), atol, rtol)
            if why:
                return {**verdict, "status": "wrong", "reason": f"trial {i}: {why}"}
        for r, data in inputs[trials:]:
            cand.call({"op": "stage", "tensors": r["tensors"]}, data)
        took, digests = cand.timed()  # warm-up, checked too
        times = []
        for _ in range(repeats):
            if not digests_match(ref_digests, digests, atol, rtol):
                return {**verdict, "status": "wrong",
                        "reason": "the timed runs' outputs differ from the reference's "
                                  "(work skipped, cached or left unfinished?)"}
            took, digests = cand.timed()
            times.append(took)
        if not digests_match(ref_digests, digests, atol, rtol):
            return {**verdict, "status": "wrong", "reason": "timed outputs differ"}
    except TimeoutError:
        return {**verdict, "status": "timeout", "reason": f"over {timeout:g} s"}
    except (WorkerError, EOFError, KeyError, ValueError) as exc:
        return {**verdict, "status": "runtime_error",
                "reason": f"{exc}; {cand.stderr_tail()}".strip()[:2000]}
    finally:
        cand.end()
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
