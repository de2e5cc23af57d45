"""corral's episode runner for policy evaluation; it runs INSIDE the sandbox.

corral copies this file (with ``job.json``, the policy's files and, for tic-tac-toe,
the env) into a base sandbox, snapshots it, and runs it in sandboxes restored from
that snapshot. It imports only the standard library (and gymnasium when the env is one
of its ids), because the sandbox has nothing else: not even corral.

The policy runs in a process of its own, forked before any of its code is imported
(:func:`start_policy`): the runner (env, seeds, records) makes itself non-dumpable, so
the policy, of the same uid, cannot open its ``/proc/PID/mem`` or ``fd``, and the
policy's process holds only a pipe pair: observations in, actions out (one JSON line
each way a step; numpy arrays as lists with their dtype). The runner accepts from it
only plain numbers, strings, lists and numeric arrays, a line of at most
:data:`MAX_MESSAGE` bytes, and never unpickles or evaluates anything: a policy that
patches ``emit`` or the env patches its own copies. The policy's process keeps a mirror
of the env (reset and stepped with the same seeds and actions) as its module's ``env``.

    python3 runner.py check                 # load the policy, make the env, step once
    python3 runner.py warm                  # make the env only (compiles its byte-code)
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
MAX_MESSAGE = 1 << 20
"""Bytes of one action line from the policy's process; a longer one ends that process."""


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
    import json  # already in sys.modules after the fork (start_policy)

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
        source = f.read()
    exec(compile(source, path, "exec"), module.__dict__)
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


def run_episode(env, policy, seed, k, max_steps, timeout=None):
    """One episode's record; ``timeout``: its seconds (the policy's process is ended,
    and the episode timed out, when they pass while the runner waits on it)."""
    rng_seed = episode_seed(seed, k)
    seed_globals(rng_seed)
    started = time.perf_counter()
    if timeout is not None:
        policy.deadline = time.monotonic() + timeout
        policy.timeout_message = f"the episode ran past its {timeout:g} s timeout"
    steps, total, where = 0, 0.0, "env.reset"
    terminated = truncated = False
    digest = None
    try:
        obs, _ = env.reset(seed=seed)
        space = getattr(env, "action_space", None)
        if space is not None and hasattr(space, "seed"):
            space.seed(rng_seed)
        digest = sha256(dumps(plain(obs)).encode())
        message = {"reset": [seed, rng_seed], "obs": encode(obs)}
        while not (terminated or truncated):
            where = "policy"
            action = policy.ask(message)
            where = "env.step"
            obs, reward, terminated, truncated, _ = env.step(action)
            steps += 1
            total += float(reward)
            digest.update(dumps([plain(action), float(reward), plain(obs)]).encode())
            if max_steps is not None and steps >= max_steps and not terminated:
                truncated = True
            message = {"obs": encode(obs)}
    except Exception as exc:  # the policy's (or the env's) failure is this episode's result
        error = str(exc) if isinstance(exc, PolicyError) else f"{type(exc).__name__}: {exc}"
        record = {"seed": seed, "k": k, "error": error[:500], "where": where, "steps": steps}
        if isinstance(exc, PolicyTimeout):
            record["timed_out"] = True
        if digest is not None:  # of the trajectory up to the failure
            record["digest"] = digest.hexdigest()[:16]
        return record
    return {"seed": seed, "k": k, "return": total, "steps": steps, "terminated": bool(terminated),
            "truncated": bool(truncated), "digest": digest.hexdigest()[:16],
            "seconds": round(time.perf_counter() - started, 6)}


def seed_globals(rng_seed):
    random.seed(rng_seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(rng_seed % 2**32)


def check(job):
    """Load everything and take one step, so a broken policy fails once, clearly."""
    import traceback  # before the fork: see start_policy

    try:
        env = make_env(job)
        policy = start_policy(job, env)
        if policy.load_error is not None:
            emit(policy.load_error)
            return 3
        obs, _ = env.reset(seed=0)
        env.step(policy.ask({"reset": [0, None], "obs": encode(obs)}))
        env.close()
    except PolicyError as exc:
        emit({"check": "error", "error": str(exc), "at": exc.at})
        return 3
    except Exception as exc:
        emit({"check": "error", "error": f"{type(exc).__name__}: {exc}"[:1000],
              "at": where_in(traceback.extract_tb(exc.__traceback__))})
        return 3
    emit({"check": "ok", "python": sys.version.split()[0],
          "uncached": uncached() + policy.uncached})
    return 0


def where_in(frames):
    return next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)
                 if f.filename.startswith(HERE)), "")


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
    if argv[:1] == ["warm"]:  # byte-code for the env's modules; no policy is loaded
        make_env(job).reset(seed=0)
        return 0
    if argv[:1] not in (["run"], ["serve"]):
        print("usage: runner.py check | run SEED:K ... | serve", file=sys.stderr)
        return 2
    env = make_env(job)
    policy = start_policy(job, env)
    if policy.load_error is not None:
        print(f"the policy did not load: {policy.load_error['error']}", file=sys.stderr)
        return 3
    items = argv[1:]
    if argv[0] == "serve":
        # Pre-started (corral.rl._eval_live): everything is loaded, the policy in its
        # own process; corral checkpoints both here and restores a copy into each
        # episode's sandbox, which is told its episodes on stdin. One line, then the
        # processes end: never reused.
        emit("READY")
        items = sys.stdin.readline().split()
    try:
        for item in items:
            seed, k = (int(x) for x in item.split(":"))
            record = run_episode(env, policy, seed, k, job["env"].get("max_steps"),
                                 job.get("timeout"))
            emit(record)
    finally:
        policy.close()
        env.close()
    return 0


class PolicyError(Exception):
    """The policy's process failed a step; the message is the episode's error (``at``:
    where in the policy's files, when it raised)."""

    def __init__(self, message, at=""):
        super().__init__(message)
        self.at = at


class PolicyTimeout(PolicyError):
    """The policy's process did not answer within its episode's timeout."""


def encode(x):
    """An observation or action as plain JSON (numpy arrays and scalars keep their dtype,
    tuples and dicts their kind)."""
    if hasattr(x, "dtype") and hasattr(x, "tolist"):
        return {"nd" if getattr(x, "ndim", 0) else "np": x.tolist(), "dt": x.dtype.str}
    if isinstance(x, tuple):
        return {"t": [encode(v) for v in x]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {"d": [[str(k), encode(v)] for k, v in x.items()]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"the policy returned a {type(x).__name__}: not an action")


def decode(x, depth=0):
    """What :func:`encode` made, checked: only numbers, strings, lists, tuples, dicts of
    them and numeric numpy values; anything else raises ``ValueError``."""
    if depth > 32:
        raise ValueError("nested too deep")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [decode(v, depth + 1) for v in x]
    if t is not dict or len(x) not in (1, 2):
        raise ValueError(f"not an action: {t.__name__}")
    if "t" in x and type(x["t"]) is list:
        return tuple(decode(v, depth + 1) for v in x["t"])
    if "d" in x and type(x["d"]) is list:
        return {str(k): decode(v, depth + 1) for k, v in x["d"]}
    dt, kind = x.get("dt"), "nd" if "nd" in x else "np"
    if kind not in x or type(dt) is not str or len(x) != 2:
        raise ValueError("not an action: an unknown object")
    if not (len(dt) <= 4 and dt[:1] in "<>|=" and dt[1:2] in "biuf" and dt[2:].isdigit()):
        raise ValueError(f"not a numeric dtype: {dt[:20]!r}")
    value = decode(x[kind], depth + 1)
    np = sys.modules.get("numpy")
    if np is None:  # an env without numpy gets the plain value
        return value
    dtype = np.dtype(dt)
    return np.asarray(value, dtype=dtype) if kind == "nd" else dtype.type(value)


def non_dumpable():
    """No ``/proc/PID/mem``, ``fd``, ptrace for processes of this uid (the policy's)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise SystemExit("runner: cannot make itself non-dumpable")


class Policy:
    """The policy's process, seen from the runner: :meth:`ask` sends a message
    (``{"obs"}``, with ``"reset": [seed, rng_seed]`` at an episode's start) and returns
    the action, checked. ``load_error``: the check's report when the policy did not load."""

    def __init__(self, pid, to_policy, from_policy):
        self.pid, self.to_policy, self.from_policy = pid, to_policy, from_policy
        self.buffer, self.gone, self.timed_out = b"", None, False
        self.load_error, self.uncached = None, 0
        self.deadline = None  # time.monotonic()'s, for the current episode
        self.timeout_message = "the episode ran past its timeout"

    def send(self, message):
        data = (dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self.to_policy, data):]

    def receive(self):
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_MESSAGE:
                raise PolicyError(f"the policy's process sent more than {MAX_MESSAGE} bytes")
            if self.deadline is not None:
                left = max(0.0, self.deadline - time.monotonic())
                if not select.select([self.from_policy], [], [], left)[0]:
                    raise PolicyTimeout(self.timeout_message)
            chunk = os.read(self.from_policy, 1 << 16)
            if not chunk:
                raise PolicyError("the policy's process ended")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        if len(line) > MAX_MESSAGE:
            raise PolicyError(f"the policy's process sent more than {MAX_MESSAGE} bytes")
        reply = loads(line.decode())
        if type(reply) is not dict:
            raise ValueError("not a reply")
        return reply

    def ask(self, message):
        if self.gone is not None:
            raise (PolicyTimeout if self.timed_out else PolicyError)(self.gone)
        try:
            self.send(message)
            reply = self.receive()
        except PolicyError as exc:
            self.timed_out = isinstance(exc, PolicyTimeout)
            self.end(str(exc))
            raise
        except Exception as exc:  # garbage, a broken pipe: the process is done for
            self.end(f"PolicyProtocolError: the policy's process sent no valid reply "
                     f"({type(exc).__name__}: {str(exc)[:200]})")
            raise PolicyError(self.gone) from None
        if "a" in reply:
            try:
                return decode(reply["a"])
            except Exception as exc:
                raise PolicyError(f"InvalidAction: {type(exc).__name__}: {str(exc)[:200]}") from None
        error, at = reply.get("error"), reply.get("at")
        if type(error) is not str:
            raise PolicyError("PolicyProtocolError: no action")
        raise PolicyError(error[:1000], at[:200] if type(at) is str else "")

    def end(self, why):
        self.gone = why
        self.close()

    def close(self):
        if self.pid is None:
            return
        for fd in (self.to_policy, self.from_policy):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except OSError:
            pass
        self.pid = None


def start_policy(job, env):
    """Fork the policy's process, which loads the policy, and wait for its word. The
    runner is non-dumpable first; the child keeps stdin /dev/null, stdout and stderr
    the runner's stderr, and its two pipe ends (3, 4): nothing else.

    After the fork the runner imports nothing more: the policy's process shares its
    directory (``sys.path[0]``, where the policy's files are and which it may write),
    and a ``select.py`` it planted there ran inside the runner when the runner first
    imported ``select``. What the runner needs is imported here, before the fork, and
    its directory leaves ``sys.path`` (tests/security/test_eval_runner_imports.py)."""
    global select
    import select

    if not _LEAN:
        import json  # noqa: F401 (dumps and loads find it in sys.modules)
    non_dumpable()
    obs_r, obs_w = os.pipe()
    act_r, act_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(2, 1)
            os.dup2(obs_r, 3)
            os.dup2(act_w, 4)
            os.closerange(5, 1 << 16)
            policy_main(job, env, 3, 4)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(0)
    os.close(obs_r)
    os.close(act_w)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    for fd in (obs_w, act_r):
        os.set_inheritable(fd, False)
    policy = Policy(pid, obs_w, act_r)
    try:
        word = policy.receive()
    except Exception as exc:
        word = {"error": f"the policy's process ended while loading ({exc})"}
    if "ok" in word and type(word["ok"]) is int:
        policy.uncached = word["ok"]
    else:
        error, at = word.get("error"), word.get("at")
        policy.load_error = {"check": "error", "error": str(error)[:1000],
                             "at": at[:200] if type(at) is str else ""}
        policy.close()
    return policy


def policy_main(job, env, inp, out):
    """The policy's process: load it, then one action per observation."""
    global RECORDS
    RECORDS = None

    def send(message):
        data = (dumps(message) + "\n").encode()
        while data:
            data = data[os.write(out, data):]

    try:
        act, module = load_policy(job)
    except Exception as exc:
        import traceback

        send({"error": f"{type(exc).__name__}: {exc}"[:1000],
              "at": where_in(traceback.extract_tb(exc.__traceback__))})
        return
    send({"ok": uncached()})
    last = None
    with os.fdopen(inp, "rb") as lines:
        for line in lines:
            message = loads(line.decode())
            if "reset" in message:
                seed, rng_seed = message["reset"]
                if rng_seed is not None:
                    seed_globals(rng_seed)
                try:
                    env.reset(seed=seed)
                except Exception:
                    pass  # the runner's env is the one that counts
                space = getattr(env, "action_space", None)
                if rng_seed is not None and space is not None and hasattr(space, "seed"):
                    space.seed(rng_seed)
                if module is not None:
                    module.env = env
            elif last is not None:
                try:
                    env.step(last)
                except Exception:
                    pass
            try:
                last = act(decode(message["obs"]))
                reply = {"a": encode(last)}
            except Exception as exc:  # the policy's failure is the episode's result
                import traceback

                reply = {"error": f"{type(exc).__name__}: {exc}"[:1000],
                         "at": where_in(traceback.extract_tb(exc.__traceback__))}
            send(reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
