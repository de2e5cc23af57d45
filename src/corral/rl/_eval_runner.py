"""corral's episode runner for policy evaluation; it runs INSIDE the sandbox.

corral copies this file (with ``job.json``, the policy's files and, for tic-tac-toe,
the env) into a base sandbox, snapshots it, and runs it in sandboxes restored from
that snapshot. Policy and env share this one process, so an episode costs function
calls, not round trips. It imports only the standard library (and gymnasium when the
env is one of its ids), because the sandbox has nothing else: not even corral.

    python3 runner.py check                 # load the policy, make the env, step once
    python3 runner.py run SEED:K [SEED:K]   # one JSON record per episode, on stdout
    python3 runner.py serve                 # pre-started: READY, then ONE line of SEED:K

Records (and ``READY``, and the check's report) go to the runner's **own** copy of its
stdout, taken before the policy is loaded; file descriptor 1 then points at stderr, so
whatever the policy (or anything it starts) prints lands there and is never read as a
record: a policy printing ``{"seed": 0, "k": 0, "return": 1e9}`` scores nothing.

A record: ``{"seed", "k", "return", "steps", "terminated", "truncated", "digest",
"seconds"}``, or ``{"seed", "k", "error", "where", "steps", "digest"}`` when the policy
or the env raised (the next episode still runs; no digest if ``reset`` raised). ``digest`` is a SHA-256 of every
observation, action and reward, so equal digests mean equal trajectories.

Episode ``k`` of a seed resets the env with ``seed``; the policy's randomness
(``random``, numpy's global generator, the action space) is seeded with ``seed`` for
``k == 0`` and with a number derived from both otherwise.
"""

import os
import random
import sys
import time
import types

# Every import here is paid once per episode sandbox: keep them few (no importlib.util,
# no traceback outside the check, no typing in the env). ``json`` imports ``re`` (and
# with it enum, functools, collections) and ``hashlib`` loads OpenSSL: together about
# half of a fresh runner's CPU in a tic-tac-toe sandbox. Their C cores (``_json``,
# ``_sha256``) give the same bytes without either; the modules stay the fallback.
try:
    from _sha256 import sha256  # CPython <= 3.11
except ImportError:
    try:
        from _sha2 import sha256  # CPython >= 3.12
    except ImportError:
        from hashlib import sha256

HERE = os.path.dirname(os.path.abspath(__file__))


def _not_json(o):
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


class _Context:
    """What ``_json.make_scanner`` reads off a ``json.JSONDecoder`` (its defaults)."""
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name):
        return {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}[name]


def _lean_dumps(obj):
    if isinstance(obj, str):
        return _ascii(obj)
    # what json.JSONEncoder.iterencode builds for json.dumps's defaults (a new one per
    # call, as json.dumps makes: a failed call may leave marks in its circularity check)
    return "".join(_make_encoder({}, _not_json, _ascii, None, ": ", ", ", False, False, True)(obj, 0))


def _lean_loads(text):
    obj, end = _make_scanner(_Context())(text, 0)
    if end != len(text.rstrip()):
        raise ValueError(f"extra data at {end}")
    return obj


try:
    from _json import encode_basestring_ascii as _ascii
    from _json import make_encoder as _make_encoder
    from _json import make_scanner as _make_scanner

    _SAMPLE = '{"a": [1, -2.5, "\\u00e9", null, true, NaN]}'
    _LEAN = _lean_dumps(_lean_loads(_SAMPLE)) == _SAMPLE  # this Python's _json is as expected
except Exception:  # another Python (or another _json): the json module itself
    _LEAN = False


def dumps(obj):
    """``json.dumps(obj)`` (its default arguments), byte for byte."""
    if _LEAN:
        return _lean_dumps(obj)
    import json

    return json.dumps(obj)


def loads(text):
    """``json.loads(text)`` for a document corral wrote (no whitespace around it)."""
    if _LEAN:
        return _lean_loads(text)
    import json

    return json.loads(text)


def plain(x):
    """A JSON-able copy of an observation, action or info (numpy arrays become lists)."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def load_module(path, name):
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), module.__dict__)
    return module


def linear_policy(path):
    with open(path) as f:
        data = loads(f.read())
    w, b = data["W"], data["b"]

    def flat(obs):
        out = []
        for v in (obs if isinstance(obs, (list, tuple)) else plain(obs)):
            out.extend(flat(v) if isinstance(v, (list, tuple)) else [float(v)])
        return out

    if w and isinstance(w[0], list):
        def act(obs):
            x = flat(obs)
            scores = [sum(wi * xi for wi, xi in zip(row, x, strict=True)) + bi for row, bi in zip(w, b, strict=True)]
            return max(range(len(scores)), key=scores.__getitem__)
    else:
        def act(obs):
            return int(sum(wi * xi for wi, xi in zip(w, flat(obs), strict=True)) + b[0] > 0)
    return act, None


def load_policy(job):
    policy = job["policy"]
    if policy["kind"] == "linear":
        return linear_policy(os.path.join(HERE, policy["weights"]))
    module = load_module(os.path.join(HERE, policy["module"]), "policy")
    for name in ("act", "choose_action"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn, module
    raise TypeError("the policy module defines neither act(obs) nor choose_action(obs)")


def make_env(job):
    spec = job["env"]
    kwargs = spec.get("kwargs") or {}
    if spec["id"] == "corral/TicTacToe-v0":
        import tictactoe  # next to this file, which is on sys.path

        return tictactoe.TicTacToeEnv(**kwargs)
    import gymnasium

    return gymnasium.make(spec["id"], **kwargs)


def episode_seed(seed, k):
    if k == 0:
        return seed
    return int.from_bytes(sha256(f"{seed}:{k}".encode()).digest()[:4], "big")


def run_episode(env, act, module, seed, k, max_steps):
    rng_seed = episode_seed(seed, k)
    random.seed(rng_seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(rng_seed % 2**32)
    started = time.perf_counter()
    steps, total, where = 0, 0.0, "env.reset"
    terminated = truncated = False
    digest = None
    try:
        obs, _ = env.reset(seed=seed)
        space = getattr(env, "action_space", None)
        if space is not None and hasattr(space, "seed"):
            space.seed(rng_seed)
        if module is not None:
            module.env = env
        digest = sha256(dumps(plain(obs)).encode())
        while not (terminated or truncated):
            where = "policy"
            action = act(obs)
            where = "env.step"
            obs, reward, terminated, truncated, _ = env.step(action)
            steps += 1
            total += float(reward)
            digest.update(dumps([plain(action), float(reward), plain(obs)]).encode())
            if max_steps is not None and steps >= max_steps and not terminated:
                truncated = True
    except Exception as exc:  # the policy's (or the env's) failure is this episode's result
        record = {"seed": seed, "k": k, "error": f"{type(exc).__name__}: {exc}"[:500],
                  "where": where, "steps": steps}
        if digest is not None:  # of the trajectory up to the failure
            record["digest"] = digest.hexdigest()[:16]
        return record
    return {"seed": seed, "k": k, "return": total, "steps": steps, "terminated": bool(terminated),
            "truncated": bool(truncated), "digest": digest.hexdigest()[:16],
            "seconds": round(time.perf_counter() - started, 6)}


def check(job):
    """Load everything and take one step, so a broken policy fails once, clearly."""
    try:
        act, module = load_policy(job)
        env = make_env(job)
        obs, _ = env.reset(seed=0)
        if module is not None:
            module.env = env
        env.step(act(obs))
        env.close()
    except Exception as exc:
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        at = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)
                   if f.filename.startswith(HERE)), "")
        emit({"check": "error", "error": f"{type(exc).__name__}: {exc}"[:1000], "at": at})
        return 3
    emit({"check": "ok", "python": sys.version.split()[0], "uncached": uncached()})
    return 0


def uncached():
    """How many imported modules have no byte-code file where Python looks for it (a
    read-only folder without ``__pycache__``): each episode would compile them again."""
    return sum(1 for m in list(sys.modules.values())
               if isinstance(getattr(m, "__cached__", None), str)
               and not os.path.exists(m.__cached__))


RECORDS = None


def emit(message):
    """One line on the record channel (a dict as JSON)."""
    line = message if isinstance(message, str) else dumps(message)
    os.write(RECORDS, (line + "\n").encode())


def take_stdout():
    """Keep a private copy of stdout for the records, then point file descriptor 1 at
    stderr: the policy's prints, buffered or not, and its children's, go there."""
    global RECORDS
    sys.stdout.flush()
    RECORDS = os.dup(1)
    os.set_inheritable(RECORDS, False)  # not in the policy's subprocesses
    os.dup2(2, 1)


def main(argv):
    take_stdout()
    with open(os.path.join(HERE, "job.json")) as f:
        job = loads(f.read())
    sys.path.insert(0, HERE)
    if argv[:1] == ["check"]:
        return check(job)
    if argv[:1] not in (["run"], ["serve"]):
        print("usage: runner.py check | run SEED:K ... | serve", file=sys.stderr)
        return 2
    act, module = load_policy(job)
    env = make_env(job)
    items = argv[1:]
    if argv[0] == "serve":
        # Pre-started (corral.rl._eval_live): everything is loaded; corral checkpoints
        # this process here and restores a copy into each episode's sandbox, which is
        # told its episodes on stdin. One line, then the process ends: never reused.
        emit("READY")
        items = sys.stdin.readline().split()
    try:
        for item in items:
            seed, k = (int(x) for x in item.split(":"))
            record = run_episode(env, act, module, seed, k, job["env"].get("max_steps"))
            emit(record)
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
