"""Experience buffer: transitions streamed to Parquet or JSON Lines, read back as numpy.

A transition is ``(observation, action, reward, next_observation, terminated,
truncated, info)`` plus where it came from: ``episode_id``, ``step`` (its index in
the episode) and ``seed`` (the episode's reset seed, ``-1`` when none was given).
Episodes are appended as they finish, so a training job can stream rollouts to disk
and a replay learner can read them back::

    with ExperienceWriter("runs/cartpole.parquet", observation_space=env.observation_space,
                          action_space=env.action_space) as writer:
        writer.start_episode(seed=7)
        obs, _ = env.reset(seed=7)
        while True:
            action = env.action_space.sample()
            next_obs, reward, terminated, truncated, info = env.step(action)
            writer.add(obs, action, reward, next_obs, terminated, truncated, info)
            if terminated or truncated:        # add() ended the episode
                break
            obs = next_obs

    buf = ExperienceBuffer.load("runs/cartpole.parquet")
    buf.data.observation.shape, buf.data.observation.dtype     # (N, 4) float32
    batch = buf.sample(256, rng=0)                              # uniform replay

Episodes that ran in sandboxes come in as the bytes a sandbox produced: JSON lines
(:meth:`ExperienceWriter.add_jsonl`, e.g. a command's stdout) or a ``.npz`` of arrays
(:meth:`ExperienceWriter.add_npz`, e.g. ``sb.files.read("episode.npz")``).

Layout (the same in both formats; "leaf" = one array-valued column):

- An array observation or action of shape ``S`` and dtype ``D`` is one leaf
  ``observation`` (``action``); read back it has shape ``(N, *S)`` and dtype ``D``.
  In Parquet a scalar leaf (``S == ()``, e.g. a Discrete action, int64) is a plain
  column, any other is a fixed-size list of ``prod(S)`` values, row-major (the shape
  is in the file's metadata). In JSON Lines it is a nested list.
- A Dict observation (or action) becomes one leaf per key, ``observation.<key>``
  (nested dicts: ``observation.a.b``), and reads back as a dict of arrays. Tuple,
  Text and other spaces without a fixed shape are not supported: put them in ``info``.
- ``reward`` float64, ``terminated``/``truncated`` bool, ``step`` and ``seed`` int64.
- ``info`` is stored as JSON (numpy values become lists and numbers); read back it is
  :meth:`Transitions.infos`.

Shapes and dtypes come from gymnasium spaces (``observation_space=``,
``action_space=``) or, without them, from the first episode. Later values must have
the same shapes and cast to the same dtypes without changing kind (an int reward for
a float column is fine, a float action for an int column is not).

Crash safety: rows are written only by flushes (every ``flush_rows`` rows, at episode
boundaries, and on close). A Parquet buffer is a directory of shard files, each
written to a temporary name and renamed into place, so readers never see half a
shard; a JSON Lines buffer is one file where each flush ends with a commit line and a
reader ignores rows after the last commit. A crash loses the rows not yet flushed;
the buffer stays readable and a new writer appends to it. Several processes may write
to one Parquet directory at once (shard names are unique); a JSONL file takes one
writer at a time. ``fsync=True`` also survives power loss, at a cost per flush.
"""

from __future__ import annotations

import io
import json
import math
import operator
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from typing_extensions import Self  # typing's since 3.11 only

from corral.errors import InvalidArgument, InvalidState
from corral.rl._buffer_layout import (
    ARRAY_FIELDS,
    FORMAT_VERSION,
    META_KEY,
    NO_SEED,
    SHARD_SUFFIX,
    Format,
    Leaf,
    Spec,
    check_leaf,
    conform,
    describe,
    dump_info,
    flatten,
    jsonl_recover,
    parquet_spec,
    pyarrow_modules,
    resolve_format,
    shard_files,
    spec_from_space,
    spec_to_json,
    unflatten,
    with_next,
)
from corral.rl._buffer_reader import ExperienceBuffer, Transitions

__all__ = ["DEFAULT_FLUSH_ROWS", "NO_SEED", "ExperienceBuffer", "ExperienceWriter", "Format",
           "Transitions", "spec_from_space"]

DEFAULT_FLUSH_ROWS = 1024


class ExperienceWriter:
    """Appends episodes to a Parquet directory or a JSON Lines file (see the module doc).

    ``path`` ending in ``.jsonl`` (or ``format="jsonl"``) is one file; anything else
    is a directory of Parquet shards, created if missing. An existing buffer is
    appended to; its shapes and dtypes must match.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        format: Format | None = None,
        observation_space: Any = None,
        action_space: Any = None,
        flush_rows: int = DEFAULT_FLUSH_ROWS,
        fsync: bool = False,
    ) -> None:
        if isinstance(flush_rows, bool) or not isinstance(flush_rows, int) or flush_rows < 1:
            raise InvalidArgument(f"flush_rows must be a positive integer, got {flush_rows!r}")
        self.path = Path(path)
        self.format = resolve_format(path, format)
        self.flush_rows = flush_rows
        self.fsync = fsync
        self._token = secrets.token_hex(4)
        self._last_ns = 0
        self._episodes = 0
        self._episodes_added = 0
        self.rows_written = 0
        self._pending: list[dict[str, Any]] = []
        self._pending_rows = 0
        self._steps: list[tuple[Any, ...]] = []
        self._next_meta: dict[str, Any] = {}
        self._closed = False
        given: Spec | None = None
        if (observation_space is None) != (action_space is None):
            raise InvalidArgument("pass both observation_space and action_space, or neither")
        if observation_space is not None:
            given = {**spec_from_space("observation", observation_space),
                     **spec_from_space("action", action_space)}
        if self.format == "parquet":
            pyarrow_modules()
            self.path.mkdir(parents=True, exist_ok=True)
            shards = shard_files(self.path)
            existing = parquet_spec(shards[0]) if shards else None
        else:
            existing = jsonl_recover(self.path)
        if existing is not None and given is not None and existing != given:
            raise InvalidArgument(
                f"{self.path} holds transitions of another layout ({describe(existing)}) "
                f"than the spaces given ({describe(given)}): write to a new path"
            )
        self.spec: Spec | None = existing or given
        self._header_written = existing is not None

    # ----------------------------------------------------------- adding rows

    @property
    def episodes_written(self) -> int:
        """Episodes this writer has handed to disk (flushed)."""
        return self._episodes

    @property
    def pending_rows(self) -> int:
        """Rows of finished episodes not flushed yet (lost if the process dies now)."""
        return self._pending_rows

    def start_episode(self, *, seed: int | None = None, episode_id: str | None = None) -> None:
        """Set the seed and id of the episode that the next :meth:`add` calls record."""
        if self._steps:
            raise InvalidState("an episode is being recorded: end_episode() first")
        self._next_meta = {"seed": seed, "episode_id": episode_id}

    def add(self, observation: Any, action: Any, reward: float, next_observation: Any,
            terminated: bool, truncated: bool, info: Mapping[str, Any] | None = None) -> None:
        """Record one step; the episode ends by itself when ``terminated or truncated``."""
        self._check_open()
        self._steps.append((observation, action, reward, next_observation,
                            bool(terminated), bool(truncated), info))
        if terminated or truncated:
            self.end_episode()

    def end_episode(self) -> str | None:
        """End the episode being recorded (e.g. cut short by the caller); its id."""
        if not self._steps:
            return None
        steps, self._steps = self._steps, []
        meta, self._next_meta = self._next_meta, {}
        names = ("observation", "action", "reward", "next_observation",
                 "terminated", "truncated", "info")
        return self.add_episode([dict(zip(names, s, strict=True)) for s in steps], **meta)

    def add_episode(self, transitions: Sequence[Mapping[str, Any]] | Mapping[str, Any], *,
                    seed: int | None = None, episode_id: str | None = None) -> str:
        """Append one whole episode; returns its id.

        ``transitions`` is a list of dicts with the keys ``observation``, ``action``,
        ``reward``, ``next_observation``, ``terminated``, ``truncated`` and optionally
        ``info``, or a dict of those as arrays with one row per step (Dict
        observations as nested dicts or dotted keys, ``observation.pos``).
        """
        self._check_open()
        if isinstance(transitions, Mapping):
            columns = dict(transitions)
            raw: dict[str, Any] = {}
            for field in ARRAY_FIELDS:
                raw.update(flatten(field, columns[field] if field in columns
                                   else unflatten(columns, field)))
        else:
            rows = list(transitions)
            if not all(isinstance(r, Mapping) for r in rows):
                raise InvalidArgument("transitions must be dicts (or one dict of arrays)")
            columns, raw = {}, {}
            for key in ("reward", "terminated", "truncated", "info"):
                if rows and key in rows[0]:
                    columns[key] = [r.get(key) for r in rows]
            for i, row in enumerate(rows):
                for field in ARRAY_FIELDS:
                    if field not in row:
                        raise InvalidArgument(f"transition {i} has no {field}")
                    parts = flatten(field, row[field])
                    if i and parts.keys() != {k for k in raw if k.split(".")[0] == field}:
                        raise InvalidArgument(f"transition {i}: {field} has other keys")
                    for name, value in parts.items():
                        raw.setdefault(name, []).append(value)
        return self._append(columns, raw, seed=seed, episode_id=episode_id)

    def add_jsonl(self, data: str | bytes, *, seed: int | None = None,
                  episode_id: str | None = None) -> list[str]:
        """Append the episodes in JSON lines (e.g. the stdout of an episode run in a
        sandbox): one transition object per line, with the keys of :meth:`add_episode`
        and optionally ``episode_id`` and ``seed``. Consecutive lines with the same
        ``episode_id`` are one episode; lines without one belong to ``episode_id``
        (one episode). Returns the ids, in order."""
        text = data.decode() if isinstance(data, bytes) else data
        groups: list[tuple[Any, list[dict[str, Any]]]] = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"line {number} is not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise InvalidArgument(f"line {number} is not a JSON object")
            key = row.get("episode_id", episode_id)
            if not groups or groups[-1][0] != key:
                groups.append((key, []))
            groups[-1][1].append(row)
        return [self.add_episode(rows, seed=rows[0].get("seed", seed), episode_id=key)
                for key, rows in groups]

    def add_npz(self, data: bytes | str | os.PathLike[str], *, seed: int | None = None,
                episode_id: str | None = None) -> list[str]:
        """Append the episodes in a ``.npz`` (bytes or a path), e.g. one that an
        episode in a sandbox saved with ``numpy.savez``: arrays ``observation`` (or
        ``observation.<key>``), ``action``, ``reward``, ``next_observation``,
        ``terminated``, ``truncated`` with one row per step, and optionally ``seed``
        and ``episode_id`` (a scalar, or one per row, which splits the episodes).
        Dtypes are kept exactly."""
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        with np.load(source, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        ids = arrays.pop("episode_id", np.asarray(episode_id))
        seeds = arrays.pop("seed", np.asarray(seed))
        n = len(arrays.get("reward", ()))
        if ids.ndim == 0:
            ids = np.full(n, ids.item(), dtype=object)
        if seeds.ndim == 0:
            seeds = np.full(n, seeds.item(), dtype=object)
        bounds = [0, *(i for i in range(1, n) if ids[i] != ids[i - 1]), n]
        out = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            part = {name: arr[lo:hi] for name, arr in arrays.items()}
            s, e = seeds[lo], ids[lo]
            out.append(self.add_episode(part, seed=None if s is None else int(s),
                                        episode_id=None if e is None else str(e)))
        return out

    def _append(self, columns: dict[str, Any], raw: dict[str, Any], *, seed: int | None,
                episode_id: str | None) -> str:
        missing = [k for k in ("reward", "terminated", "truncated") if k not in columns]
        missing += [f for f in ARRAY_FIELDS if not any(n.split(".")[0] == f for n in raw)]
        if missing:
            raise InvalidArgument(f"an episode needs {', '.join(missing)} for every step")
        reward = conform("reward", columns["reward"], Leaf((), np.dtype(np.float64)))
        n = len(reward) if reward.ndim == 1 else 0
        if n == 0:
            raise InvalidArgument("an episode needs at least one transition (reward is 1-D)")
        if seed is not None:
            try:
                seed = operator.index(seed)
            except TypeError:
                raise InvalidArgument(f"seed must be an integer or None, got {seed!r}") from None
        if episode_id is not None and not isinstance(episode_id, str):
            raise InvalidArgument(f"episode_id must be a string, got {episode_id!r}")
        spec = self.spec
        if spec is None:  # the first episode sets the layout
            spec = {}
            for name, value in raw.items():
                if not name.startswith("next_"):
                    arr = np.asarray(value)
                    spec[name] = check_leaf(name, Leaf(arr.shape[1:], arr.dtype))
        full = with_next(spec)
        if set(raw) != set(full):
            raise InvalidArgument(
                f"episode has columns {sorted(raw)}, the buffer {sorted(full)}"
            )
        leaves = {name: conform(name, raw[name], leaf) for name, leaf in full.items()}
        for flag in ("terminated", "truncated"):
            leaves[flag] = conform(flag, columns[flag], Leaf((), np.dtype(bool)))
        infos = columns.get("info")
        leaves["info"] = [dump_info(i) for i in ([None] * n if infos is None else infos)]
        for name, value in leaves.items():
            if len(value) != n:
                raise InvalidArgument(f"{name} has {len(value)} rows, reward has {n}")
        self.spec = spec
        eid = episode_id or f"ep-{self._token}-{self._episodes_added}"
        self._episodes_added += 1
        self._pending.append({"episode_id": eid, "seed": seed, "n": n, "reward": reward,
                              **leaves})
        self._pending_rows += n
        if self._pending_rows >= self.flush_rows:
            self.flush()
        return eid

    # ------------------------------------------------------------- flushing

    def flush(self) -> None:
        """Write the finished episodes that are still in memory (one shard / commit)."""
        if not self._pending:
            return
        batch, rows = self._pending, self._pending_rows
        if self.format == "parquet":
            self._write_shard(batch)
        else:
            self._write_jsonl(batch, rows)
        # Only now: if a write fails (a full disk), the episodes stay pending.
        self._pending, self._pending_rows = [], 0
        self.rows_written += rows
        self._episodes += len(batch)

    def _columns(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "episode_id": [e["episode_id"] for e in batch for _ in range(e["n"])],
            "step": np.concatenate([np.arange(e["n"], dtype=np.int64) for e in batch]),
            "seed": [e["seed"] for e in batch for _ in range(e["n"])],
        }
        for name in ("reward", "terminated", "truncated", *with_next(self.spec)):
            out[name] = np.concatenate([e[name] for e in batch])
        out["info"] = [s for e in batch for s in e["info"]]
        return out

    def _write_shard(self, batch: list[dict[str, Any]]) -> None:
        pa, pq = pyarrow_modules()
        cols = self._columns(batch)
        arrays = {}
        for name, value in cols.items():
            if isinstance(value, np.ndarray) and value.ndim > 1:
                width = math.prod(value.shape[1:])
                arrays[name] = pa.FixedSizeListArray.from_arrays(
                    pa.array(value.reshape(-1)), width)
            elif name == "seed":
                arrays[name] = pa.array(value, type=pa.int64())
            elif name in ("episode_id", "info"):
                arrays[name] = pa.array(value, type=pa.string())
            else:
                arrays[name] = pa.array(value)
        meta = {"version": FORMAT_VERSION, "spec": spec_to_json(self.spec)}
        table = pa.table(arrays).replace_schema_metadata({META_KEY: json.dumps(meta)})
        # Named by wall-clock time so that sorting the names reads shards in the
        # order they were written, also across writers (the token keeps them apart).
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        final = self.path / f"part-{self._last_ns:019d}-{self._token}{SHARD_SUFFIX}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            pq.write_table(table, tmp)
            if self.fsync:
                _fsync(tmp)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _fsync(self.path)

    def _write_jsonl(self, batch: list[dict[str, Any]], rows: int) -> None:
        cols = self._columns(batch)
        lines = []
        if not self._header_written:
            header = {"corral_buffer": FORMAT_VERSION, "spec": spec_to_json(self.spec)}
            lines.append(json.dumps(header))
        names = [n for n in cols if n != "info"]
        lists = {n: (cols[n].tolist() if isinstance(cols[n], np.ndarray) else cols[n])
                 for n in names}
        for i in range(rows):
            row = {n: lists[n][i] for n in names}
            obj = {f: unflatten(row, f) for f in ("episode_id", "step", "seed", *ARRAY_FIELDS,
                                               "reward", "terminated", "truncated")}
            lines.append(json.dumps(obj, separators=(",", ":"))[:-1]
                         + ',"info":' + cols["info"][i] + "}")
        lines.append(json.dumps({"commit": rows}))
        data = memoryview(("\n".join(lines) + "\n").encode())
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                while data:  # the rows and their commit, appended together
                    data = data[os.write(fd, data):]
                if self.fsync:
                    os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, end)  # e.g. a full disk: leave no rows without a commit
                raise
        finally:
            os.close(fd)
        self._header_written = True

    def close(self) -> None:
        """End a half-recorded episode, flush everything; closing twice is fine."""
        if self._closed:
            return
        self.end_episode()
        self.flush()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidState(f"the writer of {self.path} is closed: open a new one to append")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<ExperienceWriter {self.format} {self.path} written={self.rows_written} "
                f"pending={self._pending_rows}>")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ reader
