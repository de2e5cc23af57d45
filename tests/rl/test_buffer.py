"""The experience buffer: Parquet and JSONL round trips, crash safety, replay sampling,
and CartPole episodes run in real sandboxes compared exactly with a local run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import corral
from corral.rl import ExperienceBuffer, ExperienceWriter
from corral.rl.buffer import NO_SEED
from tests.conftest import requires_root

FORMATS = ["parquet", "jsonl"]


def _path(tmp_path, fmt):
    return tmp_path / f"buf.{fmt}"


def _episode(rng, n, *, obs_shape=(4,), action_float=False):
    obs = rng.standard_normal((n + 1, *obs_shape)).astype(np.float32)
    return {
        "observation": obs[:-1],
        "next_observation": obs[1:],
        "action": (rng.standard_normal((n, 2)).astype(np.float32) if action_float
                   else rng.integers(0, 3, n)),
        "reward": rng.standard_normal(n),
        "terminated": np.arange(n) == n - 1,
        "truncated": np.zeros(n, bool),
        "info": [{"i": i, "v": np.float32(0.5)} for i in range(n)],
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_keeps_dtypes_shapes_and_metadata(tmp_path, fmt):
    rng = np.random.default_rng(0)
    eps = [_episode(rng, n, obs_shape=(2, 3)) for n in (5, 1, 7)]
    with ExperienceWriter(_path(tmp_path, fmt), flush_rows=4) as w:
        ids = [w.add_episode(e, seed=s) for e, s in zip(eps, (11, None, 13), strict=True)]
    buf = ExperienceBuffer.load(_path(tmp_path, fmt))
    d = buf.data
    assert len(buf) == 13 and buf.episode_ids == ids
    assert d.observation.shape == (13, 2, 3) and d.observation.dtype == np.float32
    assert d.action.shape == (13,) and d.action.dtype == np.int64
    assert d.reward.dtype == np.float64 and d.terminated.dtype == bool
    np.testing.assert_array_equal(d.observation, np.concatenate([e["observation"] for e in eps]))
    np.testing.assert_array_equal(d.next_observation,
                                  np.concatenate([e["next_observation"] for e in eps]))
    np.testing.assert_array_equal(d.action, np.concatenate([e["action"] for e in eps]))
    np.testing.assert_array_equal(d.reward, np.concatenate([e["reward"] for e in eps]))
    assert d.step.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6]
    assert d.seed.tolist() == [11] * 5 + [NO_SEED] + [13] * 7
    assert d.infos()[6] == {"i": 0, "v": 0.5}
    assert buf.episode(ids[2]).terminated.tolist() == [False] * 6 + [True]
    assert buf.episode_returns()[ids[0]] == pytest.approx(eps[0]["reward"].sum())


@pytest.mark.parametrize("fmt", FORMATS)
def test_dict_observations_and_float_actions(tmp_path, fmt):
    n = 3
    obs = {"image": np.arange(n * 6, dtype=np.uint8).reshape(n, 2, 3),
           "arm": {"pos": np.ones((n, 2), np.float64), "grip": np.array([True, False, True])}}
    steps = [{"observation": {"image": obs["image"][i],
                              "arm": {"pos": obs["arm"]["pos"][i], "grip": obs["arm"]["grip"][i]}},
              "next_observation": {"image": obs["image"][i] + 1,
                                   "arm": {"pos": obs["arm"]["pos"][i], "grip": True}},
              "action": np.array([0.25, -1.5], np.float32), "reward": 1,
              "terminated": i == n - 1, "truncated": False} for i in range(n)]
    with ExperienceWriter(_path(tmp_path, fmt)) as w:
        w.add_episode(steps, seed=5)
    d = ExperienceBuffer.load(_path(tmp_path, fmt)).data
    assert d.observation["image"].dtype == np.uint8 and d.observation["image"].shape == (3, 2, 3)
    np.testing.assert_array_equal(d.observation["image"], obs["image"])
    np.testing.assert_array_equal(d.next_observation["image"], obs["image"] + 1)
    assert d.observation["arm"]["grip"].dtype == bool
    assert d.observation["arm"]["grip"].tolist() == [True, False, True]
    assert d.action.dtype == np.float32 and d.action.tolist() == [[0.25, -1.5]] * 3
    assert d.reward.dtype == np.float64 and d.reward.tolist() == [1.0] * 3
    batch = d[np.array([2, 0])]
    assert batch.observation["arm"]["pos"].shape == (2, 2) and batch.step.tolist() == [2, 0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_step_api_with_gymnasium_spaces(tmp_path, fmt):
    gym = pytest.importorskip("gymnasium")
    env = gym.make("CartPole-v1")
    local = _local_cartpole([3, 4])
    with ExperienceWriter(_path(tmp_path, fmt), observation_space=env.observation_space,
                          action_space=env.action_space, flush_rows=10) as w:
        for seed in (3, 4):
            w.start_episode(seed=seed)
            obs, _ = env.reset(seed=seed)
            env.action_space.seed(seed)
            while True:
                a = env.action_space.sample()
                nxt, r, term, trunc, info = env.step(a)
                w.add(obs, a, r, nxt, term, trunc, info)  # ends the episode by itself
                if term or trunc:
                    break
                obs = nxt
        assert w.pending_rows < 10 and w.rows_written + w.pending_rows == len(local["reward"])
    d = ExperienceBuffer.load(_path(tmp_path, fmt)).data
    _assert_same(d, local)


def test_layout_errors_are_clear_and_leave_the_buffer_alone(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "b.parquet"
    with ExperienceWriter(path) as w:
        w.add_episode(_episode(rng, 3))
        with pytest.raises(corral.InvalidArgument, match="expected shape"):
            w.add_episode(_episode(rng, 3, obs_shape=(5,)))
        bad = _episode(rng, 3)
        bad["action"] = bad["action"] + 0.5  # floats for an int column
        with pytest.raises(corral.InvalidArgument, match="cannot store float64"):
            w.add_episode(bad)
        with pytest.raises(corral.InvalidArgument, match="at least one transition"):
            w.add_episode({**_episode(rng, 1), "reward": []})
        with pytest.raises(corral.InvalidArgument, match="needs terminated"):
            w.add_episode({k: v for k, v in _episode(rng, 2).items() if k != "terminated"})
        with pytest.raises(corral.InvalidArgument, match="JSON-serialisable"):
            w.add_episode({**_episode(rng, 1), "info": [{"x": object()}]})
    assert len(ExperienceBuffer.load(path)) == 3
    gym = pytest.importorskip("gymnasium")
    with pytest.raises(corral.InvalidArgument, match="another layout"):
        ExperienceWriter(path, observation_space=gym.spaces.Box(0, 1, (3,)),
                         action_space=gym.spaces.Discrete(2))
    with pytest.raises(corral.InvalidArgument, match="no fixed shape"):
        ExperienceWriter(tmp_path / "t.parquet", observation_space=gym.spaces.Text(5),
                         action_space=gym.spaces.Discrete(2))
    other = tmp_path / "notes.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(corral.InvalidArgument, match="not a corral experience buffer"):
        ExperienceWriter(other)
    assert other.read_text() == '{"hello": 1}\n'  # not truncated
    with pytest.raises(corral.InvalidArgument, match="parquet' or 'jsonl"):
        ExperienceWriter(tmp_path / "x", format="csv")
    with pytest.raises(corral.InvalidArgument, match="no experience buffer"):
        ExperienceBuffer.load(tmp_path / "missing.parquet")
    w.close()
    with pytest.raises(corral.InvalidState, match="closed"):
        w.add_episode(_episode(rng, 1))


_CRASHING_WRITER = """
import os, signal, sys
import numpy as np
from corral.rl import ExperienceWriter
path, = sys.argv[1:]
w = ExperienceWriter(path, flush_rows=10)
for i in range(7):                                   # 7 episodes of 4 rows
    n = 4
    w.add_episode({"observation": np.full((n, 3), i, np.float32),
                   "next_observation": np.full((n, 3), i + 1, np.float32),
                   "action": np.full(n, i), "reward": np.ones(n),
                   "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool)},
                  episode_id=f"e{i}", seed=i)
print(w.rows_written, w.pending_rows, flush=True)
os.kill(os.getpid(), signal.SIGKILL)                 # no close(), no atexit
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_crash_loses_only_the_unflushed_batch(tmp_path, fmt):
    path = _path(tmp_path, fmt)
    p = subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    written, pending = map(int, p.stdout.split())
    assert (written, pending) == (24, 4)  # flushes after episodes 3 and 6, e6 in memory
    buf = ExperienceBuffer.load(path)
    assert buf.episode_ids == [f"e{i}" for i in range(6)] and len(buf) == 24
    assert buf.data.action.tolist() == [i for i in range(6) for _ in range(4)]
    # A writer appends after the crash, and the whole buffer reads back.
    with ExperienceWriter(path) as w:
        w.add_episode({"observation": np.zeros((1, 3), np.float32),
                       "next_observation": np.zeros((1, 3), np.float32), "action": [9],
                       "reward": [2.0], "terminated": [True], "truncated": [False]},
                      episode_id="after")
    buf = ExperienceBuffer.load(path)
    assert buf.episode_ids[-1] == "after" and len(buf) == 25


_FULL_DISK_WRITER = """
import os, resource, signal, sys
import numpy as np
from corral.rl import ExperienceBuffer, ExperienceWriter
path, = sys.argv[1:]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # writes past the limit fail with EFBIG
def episode(i):
    return {"observation": np.full((50, 8), i, np.float64),
            "next_observation": np.full((50, 8), i, np.float64), "action": np.zeros(50),
            "reward": np.ones(50), "terminated": np.zeros(50, bool),
            "truncated": np.zeros(50, bool)}
w = ExperienceWriter(path, flush_rows=1)
w.add_episode(episode(0), episode_id="e0")
# The limit is per file: a JSONL buffer may grow a little, a new shard not at all.
limit = os.path.getsize(path) + 1000 if path.endswith(".jsonl") else 1000
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
try:
    w.add_episode(episode(1), episode_id="e1")
except OSError as exc:
    print("failed:", exc.errno, w.pending_rows, w.rows_written)
print(ExperienceBuffer.load(path).episode_ids)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))   # room again: the retry works
w.close()
print(ExperienceBuffer.load(path).episode_ids)
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_flush_keeps_the_file_readable_and_the_rows_pending(tmp_path, fmt):
    path = _path(tmp_path, fmt)
    p = subprocess.run([sys.executable, "-c", _FULL_DISK_WRITER, str(path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["failed: 27 50 50", "['e0']", "['e0', 'e1']"]  # EFBIG
    files = sorted(os.listdir(path)) if fmt == "parquet" else []
    assert not [f for f in files if f.endswith(".tmp")]


def test_torn_writes_are_ignored_and_repaired(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "b.jsonl"
    with ExperienceWriter(path) as w:
        w.add_episode(_episode(rng, 3), episode_id="kept")
    size = path.stat().st_size
    # A crash in the middle of the next flush: whole rows without their commit, then
    # half a row.
    row = path.read_text().splitlines()[1]
    with open(path, "a") as f:
        f.write(row + "\n" + row[: len(row) // 2])
    assert ExperienceBuffer.load(path).episode_ids == ["kept"]
    with ExperienceWriter(path) as w:  # opening cuts the torn tail off
        assert path.stat().st_size == size
        w.add_episode(_episode(rng, 2), episode_id="new")
    assert ExperienceBuffer.load(path).episode_ids == ["kept", "new"]
    # Parquet: a shard that was being written is ignored until renamed into place.
    pq_path = tmp_path / "b.parquet"
    with ExperienceWriter(pq_path) as w:
        w.add_episode(_episode(rng, 3), episode_id="kept")
    (pq_path / "part-9999999999999999999-deadbeef.parquet.tmp").write_bytes(b"PAR1 half a file")
    assert ExperienceBuffer.load(pq_path).episode_ids == ["kept"]


def test_two_writers_share_a_parquet_directory(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "shared.parquet"
    with ExperienceWriter(path, flush_rows=1) as a, ExperienceWriter(path, flush_rows=1) as b:
        a.add_episode(_episode(rng, 2), episode_id="a0")
        b.add_episode(_episode(rng, 3), episode_id="b0")
        a.add_episode(_episode(rng, 1), episode_id="a1")
    assert sorted(ExperienceBuffer.load(path).episode_ids) == ["a0", "a1", "b0"]
    assert len(os.listdir(path)) == 3


def test_sample_is_reproducible(tmp_path):
    rng = np.random.default_rng(4)
    with ExperienceWriter(tmp_path / "b.parquet") as w:
        for n in (10, 20, 30):
            w.add_episode(_episode(rng, n, action_float=True))
    buf = ExperienceBuffer.load(tmp_path / "b.parquet")
    a, b = buf.sample(32, rng=7), buf.sample(32, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a.observation, b.observation)
    assert a.observation.shape == (32, 4) and a.action.shape == (32, 2) and len(a.infos()) == 32
    distinct = buf.sample(60, rng=0, replace=False)
    assert len({(e, s) for e, s in zip(distinct.episode_id, distinct.step, strict=True)}) == 60
    with pytest.raises(corral.InvalidArgument, match="distinct"):
        buf.sample(61, replace=False)
    with pytest.raises(corral.InvalidArgument, match="positive"):
        buf.sample(0)


def test_ingest_jsonl_and_npz(tmp_path):
    lines = "\n".join(json.dumps({
        "episode_id": eid, "seed": seed, "observation": [float(i), 0.5],
        "next_observation": [float(i + 1), 0.5], "action": i % 2, "reward": 1,
        "terminated": False, "truncated": i == 2, "info": {"k": i}})
        for eid, seed in (("x", 1), ("y", 2)) for i in range(3))
    arrays = dict(observation=np.zeros((2, 2), np.float32), next_observation=np.ones((2, 2)),
                  action=np.array([1, 0]), reward=np.array([0.5, 0.5]),
                  terminated=np.array([False, True]), truncated=np.array([False, False]),
                  seed=np.array(9))
    npz = tmp_path / "ep.npz"
    np.savez(npz, **arrays)
    with ExperienceWriter(tmp_path / "b.parquet") as w:
        assert w.add_jsonl(lines) == ["x", "y"]
        assert w.add_npz(npz.read_bytes(), episode_id="z") == ["z"]
        with pytest.raises(corral.InvalidArgument, match="line 2 is not JSON"):
            w.add_jsonl(lines.splitlines()[0] + "\n{oops")
    buf = ExperienceBuffer.load(tmp_path / "b.parquet")
    assert buf.episode_ids == ["x", "y", "z"]
    assert buf.data.seed.tolist() == [1, 1, 1, 2, 2, 2, 9, 9]
    assert buf.data.observation.dtype == np.float64  # inferred from the JSON (first episode)
    assert buf.episode("y").infos() == [{"k": 0}, {"k": 1}, {"k": 2}]


# ---------------------------------------------------------- sandboxes, end to end

# The same code runs in the sandbox and on the host: seeded reset, seeded action space.
CARTPOLE = textwrap.dedent("""
    import json, sys
    import gymnasium as gym
    import numpy as np

    def episode(seed):
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=seed)
        env.action_space.seed(seed)
        rows = []
        while True:
            action = env.action_space.sample()
            nxt, reward, term, trunc, _ = env.step(action)
            rows.append((obs, action, reward, nxt, term, trunc))
            if term or trunc:
                return rows
            obs = nxt

    if __name__ == "__main__":
        mode, seeds = sys.argv[1], [int(s) for s in sys.argv[2:]]
        for seed in seeds:
            rows = episode(seed)
            if mode == "jsonl":
                for o, a, r, n, te, tr in rows:
                    print(json.dumps({"episode_id": f"s{seed}", "seed": seed,
                                      "observation": o.tolist(), "action": int(a),
                                      "reward": r, "next_observation": n.tolist(),
                                      "terminated": te, "truncated": tr}))
            else:
                cols = list(zip(*rows))
                np.savez(f"ep-{seed}.npz", observation=np.stack(cols[0]),
                         action=np.array(cols[1]), reward=np.array(cols[2]),
                         next_observation=np.stack(cols[3]), terminated=np.array(cols[4]),
                         truncated=np.array(cols[5]), seed=np.array(seed))
""")


def _local_cartpole(seeds):
    namespace: dict = {"__name__": "cartpole"}
    exec(compile(CARTPOLE, "cartpole", "exec"), namespace)
    rows = [row for s in seeds for row in namespace["episode"](s)]
    cols = list(zip(*rows, strict=True))
    return {"observation": np.stack(cols[0]), "action": np.array(cols[1]),
            "reward": np.array(cols[2], np.float64), "next_observation": np.stack(cols[3]),
            "terminated": np.array(cols[4]), "truncated": np.array(cols[5])}


def _assert_same(data, local):
    for name, expected in local.items():
        got = getattr(data, name)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)  # bit for bit


@requires_root
@pytest.mark.parametrize("fmt", FORMATS)
def test_cartpole_from_a_sandbox_matches_a_local_run(tmp_path, client, fmt):
    gym = pytest.importorskip("gymnasium")
    env = gym.make("CartPole-v1")
    seeds = [0, 1, 2]
    path = _path(tmp_path, fmt)
    with corral.Sandbox.create(image="rl", memory_mb=512, timeout=300, client=client) as sb, \
            ExperienceWriter(path, observation_space=env.observation_space,
                             action_space=env.action_space) as w:
        sb.files.write("cartpole.py", CARTPOLE)
        # Path 1: JSON lines on stdout.
        r = sb.exec(["python3", "cartpole.py", "jsonl", "0", "1"], timeout=120, check=True)
        assert w.add_jsonl(r.stdout) == ["s0", "s1"]
        # Path 2: a .npz file written in the sandbox and downloaded (dtypes exact).
        sb.exec(["python3", "cartpole.py", "npz", "2"], timeout=120, check=True)
        assert w.add_npz(sb.files.read("ep-2.npz"), episode_id="s2") == ["s2"]
    buf = ExperienceBuffer.load(path)
    assert buf.episode_ids == ["s0", "s1", "s2"]
    _assert_same(buf.data, _local_cartpole(seeds))
    assert buf.data.observation.dtype == np.float32 and buf.data.action.dtype == np.int64
    assert sorted(set(buf.data.seed.tolist())) == seeds
    with pytest.raises(corral.SandboxNotFound):
        sb.refresh()  # deleted with its block
