"""Gymnasium environments hosted in sandboxes: step round trip and vector throughput.

    python3 benchmarks/bench_gym.py [--quick] [--json OUT] [--envs 1,2,4,8]

Starts a private daemon and measures, in one run:

- ``gym_step_inprocess_us_p50``: ``gymnasium.make("CartPole-v1").step`` in this
  process (the baseline);
- ``gym_sandbox_step_ms_p50``: ``corral.rl.SandboxEnv("CartPole-v1").step``, the env
  in a sandbox (image ``rl``), over its port channel: on the daemon's Unix socket the
  connection to the server's loopback port handed over (``corral.server.port_socket``'s
  handoff: no relay);
- ``gym_sandbox_step_websocket_ms_p50``: the same over the WebSocket the daemon relays
  (what a client on TCP gets, and every client before the handoff);
- ``gym_sandbox_step_stdio_ms_p50``: the same with ``port_channel=False``: one
  ``write`` per step, the reply read from the server's open output stream;
- ``gym_async_vector_step_ms_p50``: one step of gymnasium's own ``AsyncVectorEnv``
  with one CartPole in a subprocess (pipes, no isolation): the peer a user would
  otherwise pick;
- ``process_exchange_ms_p50`` / ``process_write_readline_ms_p50``: a line echoed by a
  process in a sandbox, by one ``exchange`` request against ``write`` + ``readline`` on
  the process's open output stream (the two ways of the process API);
- ``gym_vector_steps_per_s_N``: env steps per second of ``SandboxVectorEnv`` with N
  sandboxes (one ``exchange_all`` request per vector step), next to
  ``gym_vector_inprocess_steps_per_s_N``, gymnasium's ``SyncVectorEnv`` here, and
  ``gym_async_vector_steps_per_s_N``, its ``AsyncVectorEnv`` (N subprocesses).

Actions come from a seeded action space; episodes autoreset. Needs root and the
``rl`` image.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym

import corral
import corral.rl
from corral.rl import _port_channel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import pct, private_daemon  # noqa: E402  (a sibling script, not a package)

ROUNDS = 5
ECHO = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()\n"


def step_times(env: gym.Env, n: int) -> list[float]:
    """Milliseconds per ``step`` over ``n`` seeded steps (resets not timed)."""
    env.reset(seed=0)
    env.action_space.seed(0)
    times = []
    for _ in range(n):
        action = env.action_space.sample()
        started = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        times.append((time.perf_counter() - started) * 1000)
        if terminated or truncated:
            env.reset()
    return times


def vector_rate(envs: gym.vector.VectorEnv, n: int) -> float:
    """Env steps per second over ``n`` vector steps."""
    envs.reset(seed=0)
    envs.action_space.seed(0)
    actions = [envs.action_space.sample() for _ in range(n)]
    started = time.perf_counter()
    for action in actions:
        envs.step(action)
    return n * envs.num_envs / (time.perf_counter() - started)


def echo_times(sb: corral.Sandbox, n: int) -> tuple[list[float], list[float]]:
    """Milliseconds per echoed line: by ``exchange``, and by ``write`` + ``readline``."""
    with sb.spawn(["python3", "-c", ECHO]) as proc:
        proc.exchange("warm\n")
        exchange = []
        for i in range(n):
            started = time.perf_counter()
            proc.exchange(f"line {i}\n")
            exchange.append((time.perf_counter() - started) * 1000)
    with sb.spawn(["python3", "-c", ECHO]) as proc:
        proc.write("warm\n")
        proc.readline()
        streamed = []
        for i in range(n):
            started = time.perf_counter()
            proc.write(f"line {i}\n")
            proc.readline()
            streamed.append((time.perf_counter() - started) * 1000)
    return exchange, streamed


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--envs", default="1,2,4,8", help="vector sizes (default 1,2,4,8)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 2000, 300, 10)
    sizes = [int(x) for x in args.envs.split(",")]
    res: dict[str, float] = {}
    with private_daemon("corral-bench-gym-") as url, corral.Client(url) as client:
        local = gym.make("CartPole-v1")
        step_times(local, 100)  # warm up
        inproc = step_times(local, n)
        sandboxed = corral.rl.SandboxEnv("CartPole-v1", client=client)
        handed = _port_channel._handed
        _port_channel._handed = lambda address, path: None  # this one gets the WebSocket
        try:
            relayed = corral.rl.SandboxEnv("CartPole-v1", client=client)
        finally:
            _port_channel._handed = handed
        stdio = corral.rl.SandboxEnv("CartPole-v1", client=client, port_channel=False)
        peer = gym.vector.AsyncVectorEnv([lambda: gym.make("CartPole-v1")])
        try:
            for env in (sandboxed, relayed, stdio, peer):
                step_times(env, 100)
            remote, websocket, plain, async_peer = [], [], [], []
            for _ in range(ROUNDS):  # in turns, so a change of the host's load hits all
                remote += step_times(sandboxed, max(1, n // ROUNDS))
                websocket += step_times(relayed, max(1, n // ROUNDS))
                plain += step_times(stdio, max(1, n // ROUNDS))
                async_peer += step_times(peer, max(1, n // ROUNDS))
            exchange, streamed = echo_times(sandboxed.sandbox, n)
        finally:
            for env in (sandboxed, relayed, stdio, peer):
                env.close()
        res["gym_step_inprocess_us_p50"] = statistics.median(inproc) * 1000
        res["gym_sandbox_step_ms_p50"] = statistics.median(remote)
        res["gym_sandbox_step_ms_p95"] = pct(remote, 0.95)
        res["gym_sandbox_step_websocket_ms_p50"] = statistics.median(websocket)
        res["gym_sandbox_step_stdio_ms_p50"] = statistics.median(plain)
        res["gym_async_vector_step_ms_p50"] = statistics.median(async_peer)
        res["process_exchange_ms_p50"] = statistics.median(exchange)
        res["process_write_readline_ms_p50"] = statistics.median(streamed)
        vector_steps = max(50, n // 4)
        for size in sizes:
            envs = corral.rl.SandboxVectorEnv("CartPole-v1", size, client=client)
            try:
                vector_rate(envs, 20)
                res[f"gym_vector_steps_per_s_{size}"] = vector_rate(envs, vector_steps)
            finally:
                envs.close()
            here = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * size)
            res[f"gym_vector_inprocess_steps_per_s_{size}"] = vector_rate(here, vector_steps)
            here.close()
            there = gym.vector.AsyncVectorEnv([lambda: gym.make("CartPole-v1")] * size)
            try:
                vector_rate(there, 20)
                res[f"gym_async_vector_steps_per_s_{size}"] = vector_rate(there, vector_steps)
            finally:
                there.close()
    base = res["gym_step_inprocess_us_p50"] / 1000
    print(f"{'figure':38} {'value':>10}")
    for key, value in res.items():
        ratio = f"  {value / base:6.0f}x in-process step" if key.endswith("_ms_p50") else ""
        print(f"{key:38} {value:10.3f}{ratio}")
    print(f"same run: SandboxEnv step {res['gym_sandbox_step_ms_p50']:.3f} ms over the port "
          f"channel (handed over), {res['gym_sandbox_step_websocket_ms_p50']:.3f} ms relayed, "
          f"{res['gym_sandbox_step_stdio_ms_p50']:.3f} ms over stdio "
          f"({res['gym_sandbox_step_stdio_ms_p50'] / res['gym_sandbox_step_ms_p50']:.2f}x); "
          f"gymnasium AsyncVectorEnv {res['gym_async_vector_step_ms_p50']:.3f} ms "
          f"(port channel / AsyncVectorEnv "
          f"{res['gym_sandbox_step_ms_p50'] / res['gym_async_vector_step_ms_p50']:.2f}x); "
          f"load {os.getloadavg()[0]:.1f}")
    res["loadavg"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
