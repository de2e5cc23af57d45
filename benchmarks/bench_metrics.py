"""What metrics and JSON request logs cost on the hot path: the same daemon with them
on and off, measured in one run.

    python3 benchmarks/bench_metrics.py [--quick] [--json OUT]

Starts three private daemons (``python -m corral.server``): ``off`` (``--no-metrics``),
``metrics`` (the default) and ``metrics_json`` (also ``--log-format json``, one log
line per request). The three take turns, one call each, timing ``sb.exec(["true"])``
through the SDK and create→ready (``Sandbox.create``; the delete is not timed), so the
host's drift hits all three alike. Reports medians, and each one over ``off``'s; also what a
scrape of ``GET /metrics`` takes with 20 sandboxes alive, and (in this process, free of
the daemons' noise) what the metrics' listeners add to each command and create. Needs root.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Iterator

import httpx

import corral

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import private_daemon  # noqa: E402  (a sibling script, not a package)

CONFIGS = {"off": ["--no-metrics"], "metrics": [], "metrics_json": ["--log-format", "json"]}


@contextlib.contextmanager
def daemons() -> Iterator[dict[str, str]]:
    """One private daemon per config; yields their URLs."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(private_daemon(f"corral-bench-{name}-", *extra))
               for name, extra in CONFIGS.items()}


def timed_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def create_ready_ms(client: corral.Client) -> float:
    t = time.perf_counter()
    sb = corral.Sandbox.create(memory_mb=64, client=client)
    took = (time.perf_counter() - t) * 1000
    sb.delete()
    return took


def scrape_ms(url: str, n: int) -> float:
    transport = httpx.HTTPTransport(uds=url.removeprefix("unix://"))
    with httpx.Client(transport=transport, base_url="http://corral") as c:
        c.get("/metrics").raise_for_status()
        return statistics.median(timed_ms(lambda: c.get("/metrics")) for _ in range(n))


def listener_us(n: int = 200_000) -> dict[str, float]:
    """In this process, without noise from the daemons: what announcing a command's end
    and a create's end costs with the metrics' listeners subscribed, and without."""
    from types import SimpleNamespace

    from corral.runtime.events import CommandEnded, Events
    from corral.schema import ExecResult
    from corral.server.metrics import Metrics
    from corral.server.service import CreateFinished

    result = ExecResult(returncode=0, duration=0.002)
    command = CommandEnded(sandbox_id="sb-x", argv=("true",), started_at=1.0, ended_at=1.002,
                           outcome="exit", exit_code=0, stdout_tail=b"", stderr_tail=b"",
                           result=result)
    create = CreateFinished("ok", 1.0, 1.001, 1.02)
    bare = Events()
    stand_in = SimpleNamespace(events=Events())  # Metrics keeps it for scrapes only
    Metrics(stand_in, stand_in)  # type: ignore[arg-type]

    def per_call_us(events: Events, event: object) -> float:
        t = time.perf_counter()
        for _ in range(n):
            events.emit(event)
        return (time.perf_counter() - t) / n * 1e6

    return {
        "exec_event_us_bare": per_call_us(bare, command),
        "exec_event_us_metrics": per_call_us(stand_in.events, command),
        "create_event_us_metrics": per_call_us(stand_in.events, create),
    }


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemons run real sandboxes)")
        return 1
    rounds, execs, creates = bench_args.pick(args, (10, 100, 8), (5, 40, 4), (1, 4, 1))
    exec_ms: dict[str, list[float]] = {name: [] for name in CONFIGS}
    create_ms: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with daemons() as urls, contextlib.ExitStack() as stack:
        clients = {n: stack.enter_context(corral.Client(url)) for n, url in urls.items()}
        boxes = {n: stack.enter_context(corral.Sandbox.create(memory_mb=64, client=c))
                 for n, c in clients.items()}
        for sb in boxes.values():
            sb.exec(["true"])  # warm the connection
        for r in range(rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for _ in range(execs):  # one each in turn: the host's drift hits all alike
                for name in order:
                    exec_ms[name].append(timed_ms(partial(boxes[name].exec, ["true"])))
            for _ in range(creates):
                for name in order:
                    create_ms[name].append(create_ready_ms(clients[name]))
        alive = [stack.enter_context(corral.Sandbox.create(memory_mb=64, client=clients["metrics"]))
                 for _ in range(19)]
        scrape = scrape_ms(urls["metrics"], bench_args.pick(args, 50, 20, 2))
        del alive
    res: dict[str, float] = {}
    for name in CONFIGS:
        res[f"{name}_exec_rtt_ms_p50"] = statistics.median(exec_ms[name])
        res[f"{name}_create_ready_ms_p50"] = statistics.median(create_ms[name])
    for name in ("metrics", "metrics_json"):
        res[f"{name}_exec_ratio"] = res[f"{name}_exec_rtt_ms_p50"] / res["off_exec_rtt_ms_p50"]
        res[f"{name}_create_ratio"] = (res[f"{name}_create_ready_ms_p50"]
                                       / res["off_create_ready_ms_p50"])
    res["scrape_ms_p50_20_sandboxes"] = scrape
    res.update(listener_us(bench_args.pick(args, 200_000, 50_000, 1000)))
    print(f"{'config':14} {'exec p50 ms':>12} {'ratio':>6} {'create p50 ms':>14} {'ratio':>6}"
          f"   (exec n={rounds * execs}, create n={rounds * creates} each)")
    for name in CONFIGS:
        e, c = res[f"{name}_exec_rtt_ms_p50"], res[f"{name}_create_ready_ms_p50"]
        print(f"{name:14} {e:12.3f} {e / res['off_exec_rtt_ms_p50']:6.3f} {c:14.2f} "
              f"{c / res['off_create_ready_ms_p50']:6.3f}")
    print(f"GET /metrics with 20 sandboxes alive: {scrape:.2f} ms (median)")
    added = res["exec_event_us_metrics"] - res["exec_event_us_bare"]
    print(f"a command's end announced: {res['exec_event_us_bare']:.2f} us with no listener, "
          f"{res['exec_event_us_metrics']:.2f} us with the metrics' (+{added:.2f} us, "
          f"{added / 10 / res['off_exec_rtt_ms_p50']:.3f}% of an exec round trip); "
          f"a create's: {res['create_event_us_metrics']:.2f} us")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
