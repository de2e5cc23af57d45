"""How the experience buffer lays transitions out in columns and files.

Private to :mod:`corral.rl.buffer` (see its docstring for the layout users see):
leaves and their specs, checks and casts, the Parquet shard and JSONL commit formats,
and reading both back into columns.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from corral.errors import InvalidArgument

Format = Literal["parquet", "jsonl"]
NO_SEED = -1
FORMAT_VERSION = 1
META_KEY = b"corral.buffer"
ARRAY_FIELDS = ("observation", "action", "next_observation")
SHARD_SUFFIX = ".parquet"
JSONL_MAGIC = b'{"corral_buffer"'


@dataclasses.dataclass(frozen=True)
class Leaf:
    """The shape (without the leading row axis) and dtype of one array column."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype.str}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Leaf:
        return cls(tuple(int(n) for n in data["shape"]), np.dtype(data["dtype"]))


Spec = dict[str, Leaf]  # "observation" / "observation.key" / "action" ... -> Leaf


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """Flatten nested mappings into dotted leaf names: {"observation.pos": ...}."""
    if not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, sub in value.items():
        if not isinstance(key, str) or not key or "." in key:
            raise InvalidArgument(
                f"{prefix}: dict keys must be non-empty strings without '.', got {key!r}"
            )
        out.update(flatten(f"{prefix}.{key}", sub))
    return out


def unflatten(columns: Mapping[str, Any], field: str) -> Any:
    """Undo :func:`flatten` for one field."""
    if field in columns:
        return columns[field]
    out: dict[str, Any] = {}
    for name, value in columns.items():
        if not name.startswith(field + "."):
            continue
        node = out
        *parents, last = name[len(field) + 1:].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def check_leaf(name: str, leaf: Leaf) -> Leaf:
    if leaf.dtype.kind not in "biuf":
        raise InvalidArgument(
            f"{name}: dtype {leaf.dtype} is not supported: use bool, integer or float "
            "arrays (put text and other values in info)"
        )
    if any(n <= 0 for n in leaf.shape):
        raise InvalidArgument(f"{name}: shape {leaf.shape} has an empty axis")
    return leaf


def spec_from_space(field: str, space: Any) -> Spec:
    """The leaves of a gymnasium space (Box, Discrete, MultiDiscrete, MultiBinary, Dict)."""
    sub = getattr(space, "spaces", None)
    if isinstance(sub, Mapping):
        out: Spec = {}
        for key, s in sub.items():
            out.update(spec_from_space(f"{field}.{key}", s))
        return out
    shape, dtype = getattr(space, "shape", None), getattr(space, "dtype", None)
    if sub is not None or shape is None or dtype is None:
        raise InvalidArgument(
            f"{field}: {space!r} has no fixed shape and dtype: use Box, Discrete, "
            "MultiDiscrete, MultiBinary or a Dict of them (record other values in info)"
        )
    return {field: check_leaf(field, Leaf(tuple(shape), np.dtype(dtype)))}


def conform(name: str, values: Any, leaf: Leaf | None) -> np.ndarray:
    """Stack one leaf's values (one per row) into an array that matches ``leaf``."""
    try:
        arr = np.asarray(values)
    except ValueError as exc:  # ragged
        raise InvalidArgument(f"{name}: values of different shapes ({exc})") from None
    if leaf is None:
        return arr
    if arr.shape[1:] != leaf.shape:
        raise InvalidArgument(
            f"{name}: expected shape {leaf.shape} per row, got {arr.shape[1:]}: every "
            "transition of a buffer must have the same shapes"
        )
    if arr.dtype != leaf.dtype and not np.can_cast(arr.dtype, leaf.dtype, "same_kind"):
        raise InvalidArgument(
            f"{name}: cannot store {arr.dtype} values in a {leaf.dtype} column: "
            "pass matching spaces or convert the values"
        )
    return arr.astype(leaf.dtype, copy=False)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(type(value).__name__)


def dump_info(info: Any) -> str:
    try:
        return json.dumps({} if info is None else info, default=_json_default,
                          separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"info must be JSON-serialisable (numpy is fine): {exc}") from None


def resolve_format(path: str | os.PathLike[str], format: str | None) -> Format:
    """``format`` if given, else ``jsonl`` for a ``.jsonl`` path and ``parquet`` otherwise."""
    fmt = format or ("jsonl" if str(path).endswith(".jsonl") else "parquet")
    if fmt not in ("parquet", "jsonl"):
        raise InvalidArgument(f"format must be 'parquet' or 'jsonl', got {format!r}")
    return fmt  # type: ignore[return-value]


def pyarrow_modules() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidArgument(
            "the Parquet format needs pyarrow: pip install 'corral[rl]' "
            "(or use a .jsonl path)"
        ) from None
    return pa, pq


def with_next(spec: Spec | None) -> Spec:
    """The leaves of a layout plus their ``next_observation`` twins."""
    spec = spec or {}
    return {**spec, **{"next_" + n: leaf for n, leaf in spec.items()
                       if n.split(".")[0] == "observation"}}


def spec_to_json(spec: Spec | None) -> dict[str, Any]:
    return {name: leaf.to_json() for name, leaf in (spec or {}).items()}


def spec_from_json(data: Mapping[str, Any]) -> Spec:
    return {name: Leaf.from_json(leaf) for name, leaf in data.items()}


def describe(spec: Spec) -> str:
    return ", ".join(f"{n} {leaf.dtype}{list(leaf.shape)}" for n, leaf in spec.items())


def shard_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(SHARD_SUFFIX))


def parquet_spec(shard: Path) -> Spec:
    _, pq = pyarrow_modules()
    meta = (pq.read_schema(shard).metadata or {}).get(META_KEY)
    if meta is None:
        raise InvalidArgument(f"{shard} is not a corral experience shard (no layout metadata)")
    return spec_from_json(json.loads(meta)["spec"])


def jsonl_recover(path: Path) -> Spec | None:
    """Cut a torn tail (rows after the last commit) off an existing JSONL buffer and
    return its layout; ``None`` if there is no committed data."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        return None
    with open(path, "rb") as f:
        start = f.read(len(JSONL_MAGIC))
    if start and not JSONL_MAGIC.startswith(start) and not start.startswith(JSONL_MAGIC):
        raise InvalidArgument(
            f"{path} exists and is not a corral experience buffer: choose another path "
            "(to import JSON lines of transitions, use add_jsonl)"
        )
    header, _, end = scan_jsonl(path.read_bytes(), path)
    if end != path.stat().st_size:
        os.truncate(path, end)
    return None if header is None else spec_from_json(header["spec"])


def scan_jsonl(data: bytes, path: Path) -> tuple[dict | None, list[dict], int]:
    """(header, committed rows, byte offset after the last commit)."""
    header, rows, batch, pos, end = None, [], [], 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # a torn last line
        try:
            obj = json.loads(data[pos:nl])
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            if data[nl + 1:].strip():  # a crash tears only the end of the file
                raise InvalidArgument(
                    f"{path} is corrupt at byte {pos}: not a JSON object; cut the file "
                    "there or restore it"
                )
            break
        pos = nl + 1
        if "corral_buffer" in obj and header is None:
            header = obj
        elif "commit" in obj:
            if obj["commit"] != len(batch) or header is None:
                raise InvalidArgument(f"{path} is corrupt at byte {nl}: commit without its rows")
            rows += batch
            batch, end = [], pos
        else:
            batch.append(obj)
    return (header if end else None), rows, end


def read_parquet(path: Path) -> tuple[dict[str, Any], Spec]:
    pa, pq = pyarrow_modules()
    shards = shard_files(path) if path.is_dir() else [path]
    if not shards:
        raise InvalidArgument(f"{path} holds no flushed transitions yet")
    spec = parquet_spec(shards[0])
    tables = []
    for shard in shards:
        if parquet_spec(shard) != spec:
            raise InvalidArgument(f"{shard} has another layout than {shards[0]}")
        tables.append(pq.read_table(shard))
    table = pa.concat_tables(tables)
    full = with_next(spec)
    out: dict[str, Any] = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if name in full:
            leaf = full[name]
            flat = col.flatten() if pa.types.is_fixed_size_list(col.type) else col
            out[name] = flat.to_numpy(zero_copy_only=False).astype(leaf.dtype, copy=False)
            out[name] = out[name].reshape(len(col), *leaf.shape)
        elif name == "seed":
            out[name] = col.fill_null(NO_SEED).to_numpy()
        elif name in ("episode_id", "info"):
            strings = col.to_numpy(zero_copy_only=False)  # objects (str)
            out[name] = strings.astype(str) if name == "episode_id" else strings
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out, spec


def read_jsonl(path: Path) -> tuple[dict[str, Any], Spec]:
    header, rows, _ = scan_jsonl(path.read_bytes(), path)
    if header is None:
        raise InvalidArgument(f"{path} holds no committed transitions yet")
    spec = spec_from_json(header["spec"])
    full = with_next(spec)
    out: dict[str, Any] = {}
    for name, leaf in full.items():
        field, *keys = name.split(".")
        values = [_get(r[field], keys) for r in rows]
        out[name] = np.asarray(values, dtype=leaf.dtype).reshape(len(rows), *leaf.shape)
    for name, dtype in (("reward", np.float64), ("terminated", bool), ("truncated", bool),
                        ("step", np.int64)):
        out[name] = np.asarray([r[name] for r in rows], dtype=dtype)
    out["seed"] = np.asarray([NO_SEED if r["seed"] is None else r["seed"] for r in rows],
                             dtype=np.int64)
    out["episode_id"] = np.asarray([r["episode_id"] for r in rows], dtype=str)
    out["info"] = np.asarray([json.dumps(r["info"], separators=(",", ":")) for r in rows],
                             dtype=object)
    return out, spec


def _get(value: Any, keys: Iterable[str]) -> Any:
    for key in keys:
        value = value[key]
    return value
