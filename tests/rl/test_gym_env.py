"""SandboxEnv: gymnasium environments stepped inside sandboxes, values carried exactly."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env

import corral
import corral.rl
from corral.guest.env_server import serve
from corral.rl import EnvError, SandboxEnv
from corral.rl import spaces as wire
from corral.rl.gym_env import MODULES_DIR, resolve_env_id
from tests.conftest import requires_root

KITCHEN = textwrap.dedent('''
    """An env with every kind of space, for the transfer tests."""
    import os

    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces


    class Kitchen(gym.Env):
        metadata = {"render_modes": ["ansi"], "render_fps": 4}

        def __init__(self, size=3, render_mode=None):
            self.size = size
            self.render_mode = render_mode
            self.observation_space = spaces.Dict({
                "pos": spaces.Box(0, size - 1, shape=(2,), dtype=np.int32),
                "noise": spaces.Box(-1.0, 1.0, shape=(2, 2), dtype=np.float32),
                "flags": spaces.MultiBinary(3),
                "stock": spaces.MultiDiscrete([3, 4], start=[1, 0]),
                "pair": spaces.Tuple((spaces.Discrete(5, start=-2),
                                      spaces.Box(0.0, 1.0, shape=(), dtype=np.float64))),
            })
            self.action_space = spaces.Tuple((spaces.Discrete(4),
                                              spaces.Box(-1.0, 1.0, (1,), dtype=np.float32)))

        def _obs(self):
            r = self.np_random
            return {
                "pos": self._pos.copy(),
                "noise": r.uniform(-1, 1, (2, 2)).astype(np.float32),
                "flags": r.integers(0, 2, 3).astype(np.int8),
                "stock": np.array([1 + self._t % 3, self._t % 4], dtype=np.int64),
                "pair": (self._t % 5 - 2, np.array(r.random())),
            }

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self._pos = self.np_random.integers(0, self.size, 2).astype(np.int32)
            self._t = 0
            return self._obs(), {"start": self._pos.copy(), "options": options}

        def step(self, action):
            move, push = action
            print("a print from the env")  # must not disturb the protocol
            step = [(1, 0), (0, 1), (-1, 0), (0, -1)][int(move)]
            self._pos = np.clip(self._pos + step, 0, self.size - 1).astype(np.int32)
            self._t += 1
            reward = float(push[0]) if self._t % 2 else np.float32(push[0])
            return self._obs(), reward, bool(self._t >= 7), False, {"t": self._t}

        def render(self):
            return f"at {self._pos.tolist()}"

        def fail(self, message):
            raise KeyError(message)

        def die(self):
            import sys
            sys.stderr.write("going down\\n")
            sys.stderr.flush()
            os._exit(3)
''')


MARKED = textwrap.dedent("""
    import gymnasium as gym
    from gymnasium import spaces


    class Marked(gym.Env):
        observation_space = spaces.Discrete(100)
        action_space = spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 42
            return self.t, {}

        def step(self, action):
            self.t += 1
            return self.t, 0.0, False, False, {}
""")


def same(a, b) -> bool:
    """Equal and of the same types all the way down (arrays: dtype, shape, values)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == object:  # e.g. final_obs of a vector env: compare the items
            return all(same(x, y) for x, y in zip(a.flat, b.flat, strict=True))
        return a.tobytes() == b.tobytes()
    return a == b


@pytest.fixture
def kitchen(tmp_path):
    path = tmp_path / "kitchen.py"
    path.write_text(KITCHEN)
    return path


def local_kitchen(path):
    spec = importlib.util.spec_from_file_location("kitchen_local", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Kitchen


# ------------------------------------------------------------- no sandbox needed


EVERY_SPACE = [
    spaces.Box(-1.0, 1.0, (2, 3), dtype=np.float32),
    spaces.Box(np.array([0.0, -np.inf]), np.array([1.0, np.inf]), dtype=np.float64),
    spaces.Box(0, 255, (4, 4, 3), dtype=np.uint8),
    spaces.Discrete(5, start=-2),
    spaces.MultiDiscrete([3, 4], start=[1, 0]),
    spaces.MultiDiscrete(np.array([[2, 3], [4, 5]]), dtype=np.int32),
    spaces.MultiBinary(4),
    spaces.MultiBinary([2, 3]),
    spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 1, (1,)))),
    spaces.Dict([("z", spaces.Discrete(2)), ("a", spaces.Box(0, 1, (1,)))]),
    spaces.Text(5, min_length=1, charset="abc"),
    spaces.Sequence(spaces.Discrete(3), stack=True),
    spaces.OneOf([spaces.Discrete(2), spaces.Box(0, 1, (2,))]),
    spaces.Graph(spaces.Box(0, 1, (3,)), spaces.Discrete(2)),
]


@pytest.mark.parametrize("space", EVERY_SPACE, ids=lambda s: type(s).__name__)
def test_spaces_cross_faithfully(space):
    back = wire.space_from_dict(json.loads(json.dumps(wire.space_to_dict(space))))
    assert type(back) is type(space) and back == space and repr(back) == repr(space)
    if isinstance(space, spaces.Dict):
        assert list(back.keys()) == list(space.keys())  # order kept, not sorted
    space.seed(7)
    back.seed(7)
    assert same(space.sample(), back.sample())  # same sampling: same actions from a seed


def test_unsupported_space_is_a_clear_error():
    class Odd(spaces.Space):
        pass

    with pytest.raises(wire.UnsupportedSpace, match="Box, Discrete"):
        wire.space_to_dict(Odd())


@pytest.mark.parametrize("value", [
    np.float32(1.5), np.int64(-7), np.bool_(True), (1, 2.5, "x", None), [np.uint8(3)],
    {"a": np.zeros((2, 2), np.float32), 3: "an int key", (1, 2): b"\x00\xff"},
    {"__nd__": "a user dict that looks like a tag"}, np.array([1, 2], dtype=">i4"),
    np.array([1, "a", None], dtype=object), np.zeros((0, 3)), np.array(3.0),
    np.zeros(2, dtype=[("x", "<f4"), ("y", "<i2", (2,))]), 0.1, 1e300, 2**80, "é",
])
def test_values_cross_exactly(value):
    back = wire.decode(json.loads(json.dumps(wire.encode(value))))
    assert same(back, value) or (isinstance(value, np.ndarray) and value.dtype == object
                                 and list(back) == list(value))


def test_decoded_arrays_are_writable_and_unknown_objects_opaque():
    array = wire.decode(wire.encode(np.arange(3.0)))
    array[0] = 9.0
    assert wire.decode(wire.encode({"when": object})) == {"when": repr(object)}
    nan = wire.decode(json.loads(json.dumps(wire.encode(float("nan")))))
    assert nan != nan


def test_the_server_protocol_in_this_process():
    requests = io.BytesIO(b"".join([
        wire.dumps({"op": "step", "action": 0}),
        wire.dumps({"op": "make", "id": "CartPole-v1", "kwargs": {}}),
        wire.dumps({"op": "reset", "seed": 3}),
        wire.dumps({"op": "step", "action": np.int64(1)}),
        wire.dumps({"op": "step", "action": 7}),
        wire.dumps({"op": "nope"}),
        wire.dumps({"op": "close"}),
        wire.dumps({"op": "ping"}),  # after close: never read
    ]))
    replies = io.BytesIO()
    serve(requests, replies, wire)
    out = [wire.loads(line) for line in replies.getvalue().splitlines()]
    assert len(out) == 7
    assert not out[0]["ok"] and "make" in out[0]["error"]["message"]
    assert out[1]["ok"] and wire.space_from_dict(out[1]["action_space"]) == spaces.Discrete(2)
    local = gym.make("CartPole-v1")
    obs, info = local.reset(seed=3)
    assert same(out[2]["obs"], obs) and out[2]["info"] == info
    assert same(out[3]["obs"], local.step(np.int64(1))[0])
    assert not out[4]["ok"] and out[4]["error"]["type"].endswith("AssertionError")
    assert "env_server" not in out[4]["error"]["traceback"]  # the env's frames only
    assert "cartpole" in out[4]["error"]["traceback"]
    assert not out[5]["ok"] and "unknown request 'nope'" in out[5]["error"]["message"]
    assert out[6] == {"ok": True}


def test_the_server_moves_to_its_port_only_for_its_token():
    """``listen``: the reply names a loopback port; a connection with the wrong first
    line is dropped, the one with the token carries the rest; a request on stdin
    instead keeps the conversation there."""
    for move in (True, False):
        r_req, w_req = os.pipe()
        r_rep, w_rep = os.pipe()
        requests, replies = os.fdopen(r_req, "rb"), os.fdopen(w_rep, "wb")
        to_server, from_server = os.fdopen(w_req, "wb", buffering=0), os.fdopen(r_rep, "rb")
        worker = threading.Thread(target=serve, args=(requests, replies, wire), daemon=True)
        worker.start()
        to_server.write(wire.dumps({"op": "make", "id": "CartPole-v1", "kwargs": {}}))
        assert wire.loads(from_server.readline())["ok"]
        to_server.write(wire.dumps({"op": "listen", "token": "k" * 32}))
        port = wire.loads(from_server.readline())["port"]
        if move:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as wrong:
                wrong.sendall(b"guess\n" + wire.dumps({"op": "ping"}))
                assert wrong.recv(100) == b""  # dropped unanswered
            with socket.create_connection(("127.0.0.1", port), timeout=30) as right:
                right.sendall(b"k" * 32 + b"\n" + wire.dumps({"op": "reset", "seed": 3}))
                lines = right.makefile("rb")
                assert wire.loads(lines.readline())["ok"]
                right.sendall(wire.dumps({"op": "close"}))
                assert wire.loads(lines.readline()) == {"ok": True}
        else:
            to_server.write(wire.dumps({"op": "ping"}))
            assert wire.loads(from_server.readline()) == {"ok": True}
            with pytest.raises(OSError):  # the port is closed again
                socket.create_connection(("127.0.0.1", port), timeout=30).close()
            to_server.write(wire.dumps({"op": "close"}))
            assert wire.loads(from_server.readline()) == {"ok": True}
        worker.join(30)
        assert not worker.is_alive()
        for f in (requests, replies, to_server, from_server):
            f.close()


def test_env_ids_and_local_modules(tmp_path, kitchen):
    assert resolve_env_id("CartPole-v1") == ("CartPole-v1", {})
    assert resolve_env_id("my_pkg.envs:Maze") == ("my_pkg.envs:Maze", {})
    target, files = resolve_env_id(f"{kitchen}:Kitchen")
    assert target == "kitchen:Kitchen" and files == {f"{MODULES_DIR}/kitchen.py": KITCHEN.encode()}
    package = tmp_path / "mazes"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from mazes.sub.maze import Maze\n")
    (package / "sub" / "maze.py").write_text("class Maze: pass\n")
    target, files = resolve_env_id(f"{package}:Maze")
    assert target == "mazes:Maze"
    assert sorted(files) == [f"{MODULES_DIR}/mazes/__init__.py", f"{MODULES_DIR}/mazes/sub/maze.py"]
    for bad in (f"{tmp_path}/missing.py:Env", "", None):
        with pytest.raises(corral.InvalidArgument):
            resolve_env_id(bad)


# ------------------------------------------------------------------ in sandboxes


@requires_root
def test_cartpole_in_a_sandbox_is_cartpole(client):
    env = SandboxEnv("CartPole-v1", client=client)
    try:
        local = gym.make("CartPole-v1")
        assert env.observation_space == local.observation_space
        assert env.action_space == local.action_space
        assert env.metadata == local.metadata and env.render_mode is None
        assert env.spec is None and env.remote_spec.id == "CartPole-v1"
        assert env.remote_spec.max_episode_steps == 500
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_env(env)  # raises on any failure
        obs, info = env.reset(seed=11)
        expected, expected_info = local.reset(seed=11)
        assert same(obs, expected) and info == expected_info
        seeded, _ = gym.utils.seeding.np_random(11)  # as the remote one was, before its draws
        assert env.np_random.bit_generator.state == seeded.bit_generator.state
        env.action_space.seed(11)
        for _ in range(120):  # several episodes: resets after termination too
            action = env.action_space.sample()
            got, want = env.step(action), local.step(action)
            assert all(same(a, b) for a, b in zip(got, want, strict=True))
            if got[2] or got[3]:
                assert same(env.reset()[0], local.reset()[0])
        assert env._remote.channel is not None  # stepped over the port socket
        assert env.call("gravity") == 9.8  # any attribute, through the wrappers
        assert env.call("spec").startswith("EnvSpec(id='CartPole-v1'")  # not data: its repr
    finally:
        env.close()
    env.close()  # idempotent
    assert env.sandbox.id not in {sb.id for sb in corral.Sandbox.list(client=client)}


@requires_root
def test_without_the_port_channel_the_same_trajectory(client):
    env = SandboxEnv("CartPole-v1", client=client, port_channel=False)
    try:
        assert env._remote.channel is None  # stdin and stdout of the server's process
        local = gym.make("CartPole-v1")
        assert same(env.reset(seed=5)[0], local.reset(seed=5)[0])
        for action in (0, 1, 1, 0):
            assert all(same(a, b) for a, b in zip(env.step(action), local.step(action),
                                                   strict=True))
    finally:
        env.close()


BIG_ENV = textwrap.dedent('''
    import gymnasium as gym
    import numpy as np


    class Frames(gym.Env):
        """Observations of 192 KiB: many WebSocket frames a reply."""
        observation_space = gym.spaces.Box(0, 255, (256, 256, 3), dtype=np.uint8)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return self.observation_space.sample(), {}

        def step(self, action):
            return np.full((256, 256, 3), action, np.uint8), 1.0, False, False, {"echo": "x" * 70000}
''')


@requires_root
def test_big_observations_cross_the_port_channel(client, tmp_path):
    path = tmp_path / "frames.py"
    path.write_text(BIG_ENV)
    env = SandboxEnv(f"{path}:Frames", client=client)
    try:
        assert env._remote.channel is not None
        env.reset(seed=1)
        for action in (7, 200):
            obs, _, _, _, info = env.step(action)
            assert obs.shape == (256, 256, 3) and (obs == action).all()
            assert info == {"echo": "x" * 70000}
    finally:
        env.close()


@requires_root
def test_your_own_env_file(client, kitchen):
    env = SandboxEnv(f"{kitchen}:Kitchen", client=client, size=4, render_mode="ansi")
    try:
        Kitchen = local_kitchen(kitchen)
        local = Kitchen(size=4, render_mode="ansi")
        assert env.observation_space == local.observation_space
        assert env.action_space == local.action_space and env.render_mode == "ansi"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_env(env)
        obs, info = env.reset(seed=5, options={"level": 2})
        expected = local.reset(seed=5, options={"level": 2})
        assert same((obs, info), expected)
        env.action_space.seed(5)
        for _ in range(6):
            action = env.action_space.sample()
            assert same(env.step(action), local.step(action))  # float vs float32 rewards too
        assert env.render() == local.render()
        env.set_attr("size", 9)
        assert env.call("size") == 9
        local.size = 9

        with pytest.raises(EnvError) as caught:
            env.call("fail", "no such spoon")
        err = caught.value
        assert err.remote_type == "KeyError" and "no such spoon" in err.message
        assert "kitchen.py" in err.remote_traceback and "in fail" in err.remote_traceback
        assert err.details["sandbox_id"] == env.sandbox.id
        with pytest.raises(EnvError, match="IndexError"):
            env.step((7, np.zeros(1, np.float32)))  # a bad action: the env raises
        assert same(env.reset(seed=5), local.reset(seed=5))  # the env goes on

        with pytest.raises(EnvError, match="exited with status 3") as died:
            env.call("die")
        assert "going down" in died.value.message and died.value.details["returncode"] == 3
    finally:
        env.close()


@requires_root
def test_where_the_env_runs(client):
    sb = corral.Sandbox.create(image="rl", memory_mb=256, client=client)
    try:
        env = SandboxEnv("CartPole-v1", sandbox=sb)
        assert env.sandbox is sb
        env.reset(seed=0)
        env.close()
        assert sb.refresh().state == corral.SandboxState.RUNNING  # yours: left running
        sb.files.write("/workspace/envs/__init__.py", "")
        sb.files.write("/workspace/envs/marked.py", MARKED)  # set up once, in a snapshot
        snap = sb.snapshot()
    finally:
        sb.delete()
    try:
        env = SandboxEnv("envs.marked:Marked", snapshot=snap, client=client, python="python3")
        try:
            assert env.reset(seed=1)[0] == 42 and env.step(0)[0] == 43
        finally:
            env.close()
    finally:
        snap.delete()
    with corral.Pool(image="rl", memory_mb=256, min_ready=1, max_size=2, client=client) as pool:
        env = SandboxEnv("CartPole-v1", pool=pool)
        assert f"pool={pool.name}" in env.sandbox.tags
        env.close()  # an acquired sandbox is deleted with the env
        running = corral.Sandbox.list(tags=[f"pool={pool.name}"], state="running", client=client)
        assert env.sandbox.id not in {s.id for s in running}
    with pytest.raises(corral.InvalidArgument, match="at most one"):
        SandboxEnv("CartPole-v1", sandbox=sb, pool=pool)


@requires_root
def test_failures_leave_nothing_behind(client, tmp_path):
    with pytest.raises(EnvError, match="NameNotFound"):
        SandboxEnv("NoSuchEnv-v0", client=client)
    broken = tmp_path / "broken.py"
    broken.write_text("import numpy\nraise RuntimeError('import-time failure')\n")
    with pytest.raises(EnvError, match="import-time failure") as caught:
        SandboxEnv(f"{broken}:Env", client=client)
    assert "broken.py" in caught.value.remote_traceback
    notenv = tmp_path / "notenv.py"
    notenv.write_text("class Thing:\n    pass\n")
    with pytest.raises(EnvError, match="not a gymnasium.Env"):
        SandboxEnv(f"{notenv}:Thing", client=client)
    with pytest.raises(corral.ImageNotFound):
        SandboxEnv("CartPole-v1", image="no-such-image", client=client)


def test_import_registers_corral_envs_without_importing_gymnasium():
    code = ("import sys, corral.rl; assert 'gymnasium' not in sys.modules; "
            "import gymnasium as gym; spec = gym.spec('corral/SandboxEnv-v0'); "
            "assert spec.entry_point == 'corral.rl.gym_env:SandboxEnv'; "
            "assert spec.vector_entry_point == 'corral.rl.vector:SandboxVectorEnv'")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "corral/SandboxEnv-v0" in gym.registry  # gymnasium first, corral.rl after


@requires_root
def test_gym_make_make_vec_and_an_invalid_action(client):
    local = gym.make("CartPole-v1")
    # The daemon as a URL: a client object would make the spec uncopyable.
    env = gym.make("corral/SandboxEnv-v0", env_id="CartPole-v1", client=client.url)
    try:
        assert env.spec.id == "corral/SandboxEnv-v0" and env.spec.kwargs["env_id"] == "CartPole-v1"
        assert env.unwrapped.remote_spec.id == "CartPole-v1"
        obs, _ = env.reset(seed=3)
        assert same(obs, local.reset(seed=3)[0])
        with pytest.raises(AssertionError) as theirs:
            local.step(5)
        # What CartPole raises for an invalid action (an AssertionError, its message).
        with pytest.raises(AssertionError, match=re.escape(str(theirs.value))) as ours:
            env.step(5)
        assert isinstance(ours.value, EnvError) and ours.value.remote_type == "AssertionError"
        assert same(env.step(0), local.step(0))  # the env goes on
    finally:
        env.close()
    envs = gym.make_vec("corral/SandboxEnv-v0", num_envs=2, env_id="CartPole-v1",
                        client=client.url)
    try:
        assert isinstance(envs, corral.rl.SandboxVectorEnv) and envs.num_envs == 2
        assert envs.spec.id == "corral/SandboxEnv-v0"
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4) and same(obs[1], local.reset(seed=1)[0])
        assert envs.step(np.array([0, 1]))[1].tolist() == [1.0, 1.0]
    finally:
        envs.close()
