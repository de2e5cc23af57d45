"""Reading an experience buffer back: :class:`ExperienceBuffer` (whole file or shard
directory into memory, for replay sampling and analysis) and the :class:`Transitions`
columns it hands out. Writing is :mod:`corral.rl.buffer`'s :class:`ExperienceWriter`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from typing_extensions import Self  # typing's since 3.11 only

from corral.errors import InvalidArgument, InvalidState
from corral.rl._buffer_layout import (
    ARRAY_FIELDS,
    Format,
    Spec,
    read_jsonl,
    read_parquet,
    resolve_format,
    unflatten,
)


@dataclasses.dataclass(frozen=True)
class Transitions:
    """Rows of transitions as numpy arrays (every field has ``len(self)`` rows).

    ``observation``/``next_observation``/``action`` are arrays, or dicts of arrays for
    Dict spaces. ``seed`` is :data:`NO_SEED` (-1) where the episode had none.
    Index it with an int array or slice to get a subset: ``batch[idx]``.
    """

    observation: Any
    action: Any
    reward: np.ndarray
    next_observation: Any
    terminated: np.ndarray
    truncated: np.ndarray
    episode_id: np.ndarray
    step: np.ndarray
    seed: np.ndarray
    info_json: np.ndarray

    def __len__(self) -> int:
        return len(self.reward)

    def __getitem__(self, index: Any) -> Transitions:
        return Transitions(**{f.name: _take(getattr(self, f.name), index)
                              for f in dataclasses.fields(self)})

    def infos(self) -> list[dict[str, Any]]:
        """The ``info`` dicts, decoded from their stored JSON."""
        return [json.loads(s) for s in self.info_json]


def _take(value: Any, index: Any) -> Any:
    if isinstance(value, dict):
        return {k: _take(v, index) for k, v in value.items()}
    return value[index]


# ------------------------------------------------------------------ writer


class ExperienceBuffer:
    """Transitions read back into memory, for replay sampling and analysis.

    >>> buf = ExperienceBuffer.load("runs/cartpole.parquet")          # doctest: +SKIP
    >>> len(buf), buf.data.observation.shape, buf.data.action.dtype   # doctest: +SKIP
    (2113, (2113, 4), dtype('int64'))
    >>> batch = buf.sample(64, rng=np.random.default_rng(0))          # doctest: +SKIP
    """

    def __init__(self, data: Transitions, spec: Spec) -> None:
        self.data = data
        self.spec = spec

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, format: Format | None = None) -> Self:
        """Read every committed transition of a buffer (what writers have flushed)."""
        path = Path(path)
        fmt = resolve_format(path, format)
        if not path.exists():
            raise InvalidArgument(f"no experience buffer at {path}: write one with ExperienceWriter")
        columns, spec = read_parquet(path) if fmt == "parquet" else read_jsonl(path)
        arrays = {f: unflatten(columns, f) for f in ARRAY_FIELDS}
        data = Transitions(
            **arrays,
            reward=columns["reward"], terminated=columns["terminated"],
            truncated=columns["truncated"], episode_id=columns["episode_id"],
            step=columns["step"], seed=columns["seed"], info_json=columns["info"],
        )
        return cls(data, spec)

    def __len__(self) -> int:
        return len(self.data)

    @property
    def episode_ids(self) -> list[str]:
        """The episodes' ids, in the order they were written."""
        return list(dict.fromkeys(self.data.episode_id.tolist()))

    def episode(self, episode_id: str) -> Transitions:
        """The transitions of one episode, in step order."""
        index = np.flatnonzero(self.data.episode_id == episode_id)
        if not len(index):
            raise InvalidArgument(f"no episode {episode_id!r} in this buffer")
        return self.data[index]

    def episode_returns(self) -> dict[str, float]:
        """The undiscounted return of each episode."""
        ids, inverse = np.unique(self.data.episode_id, return_inverse=True)
        sums = np.bincount(inverse, weights=self.data.reward, minlength=len(ids))
        by_id = dict(zip(ids.tolist(), sums.tolist(), strict=True))
        return {eid: by_id[eid] for eid in self.episode_ids}

    def sample(self, batch_size: int, rng: np.random.Generator | int | None = None, *,
               replace: bool = True) -> Transitions:
        """``batch_size`` transitions drawn uniformly (with replacement by default);
        ``rng`` is a numpy Generator or a seed, for reproducible replay."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be a positive integer, got {batch_size!r}")
        if not len(self):
            raise InvalidState("the buffer is empty: nothing to sample")
        if not replace and batch_size > len(self):
            raise InvalidArgument(
                f"cannot draw {batch_size} distinct transitions from {len(self)}: "
                "use replace=True or a smaller batch"
            )
        index = np.random.default_rng(rng).choice(len(self), size=batch_size, replace=replace)
        return self.data[index]

    def __repr__(self) -> str:
        return f"<ExperienceBuffer {len(self)} transitions, {len(self.episode_ids)} episodes>"


