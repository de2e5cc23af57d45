"""What policy evaluation runs: a policy (code or weights) and an environment spec.

Both are turned, on the host, into a few files and a hash: the files are written once
into a base sandbox that is then snapshotted (every episode's sandbox is restored from
that snapshot, so they share the files, never copy them), and the hash keys the
result cache. Weights are loaded here, with numpy or torch as the format needs, and
handed to the sandbox as plain JSON, so the sandbox needs neither.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument
from corral.rl.envs.tictactoe import ENV_ID as TICTACTOE_ID

ENTRYPOINTS = ("act", "choose_action")
WEIGHT_SUFFIXES = (".npy", ".json", ".pt", ".pth")
CODE_FILE, WEIGHTS_FILE = "policy.py", "weights.json"
RESERVED_FILES = frozenset({CODE_FILE, WEIGHTS_FILE, "runner.py", "job.json", "tictactoe.py"})
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

TICTACTOE_ALIASES = frozenset({"tictactoe", "tic-tac-toe", "TicTacToe-v0", TICTACTOE_ID})
TICTACTOE_IMAGE, GYMNASIUM_IMAGE = "python", "rl"

# Registered envs whose return range is known when made without keyword arguments:
# (lowest reward per step, highest reward per step, the TimeLimit's steps).
STEP_REWARD_BOUNDS = {
    "CartPole-v0": (0.0, 1.0, 200), "CartPole-v1": (0.0, 1.0, 500),
    "MountainCar-v0": (-1.0, 0.0, 200), "Acrobot-v1": (-1.0, 0.0, 500),
}


def _defines_entrypoint(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ENTRYPOINTS:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in ENTRYPOINTS for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name) in ENTRYPOINTS for a in node.names):
                return True
    return False


def _as_bytes(name: str, content: bytes | str | Path) -> bytes:
    if isinstance(content, Path):
        return content.read_bytes()
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, (bytes, bytearray)):
        return bytes(content)
    raise InvalidArgument(f"policy file {name!r}: give bytes, str or a Path, got {type(content).__name__}")


def _matrix(value: Any, what: str) -> list[Any]:
    """A 1-D or 2-D list of finite floats from a list, numpy array or torch tensor."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (int, float)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"{what}: expected a non-empty 1-D or 2-D array of numbers")
    rows = value if isinstance(value[0], list) else [value]
    width = len(rows[0])
    for row in rows:
        if not isinstance(row, list) or len(row) != width or not row:
            raise InvalidArgument(f"{what}: rows of different lengths")
        for x in row:
            if isinstance(x, list):
                raise InvalidArgument(f"{what}: more than 2 dimensions (a linear policy needs "
                                      "a vector or a matrix)")
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise InvalidArgument(f"{what}: {x!r} is not a finite number")
    return [[float(x) for x in r] for r in rows] if isinstance(value[0], list) else [
        float(x) for x in value]


def _load_weights(path: Path) -> tuple[Any, Any]:
    """(weights, bias) from a ``.npy``, ``.json``, ``.pt`` or ``.pth`` file."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            import numpy
        except ImportError as exc:
            raise InvalidArgument(f"{path}: reading .npy needs numpy (pip install 'corral[rl]')") from exc
        return numpy.load(path, allow_pickle=False), None
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise InvalidArgument(f"{path}: not valid JSON: {exc}") from exc
        if isinstance(data, dict):
            w = data.get("W", data.get("weights", data.get("weight")))
            if w is None:
                raise InvalidArgument(f"{path}: a JSON object of weights needs a 'W' (or 'weights') key")
            return w, data.get("b", data.get("bias"))
        return data, None
    try:
        import torch
    except ImportError as exc:
        raise InvalidArgument(f"{path}: reading {suffix} needs torch (pip install 'corral[trl]')") from exc
    data = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(data, Mapping):  # a state dict, e.g. of one nn.Linear
        weights = [k for k in data if k == "weight" or k.endswith(".weight")]
        if len(weights) != 1:
            raise InvalidArgument(
                f"{path}: a state dict must hold exactly one '*weight' tensor (a linear policy); "
                f"it has {sorted(data)}: write the policy as code instead")
        bias = weights[0][: -len("weight")] + "bias"
        return data[weights[0]], data.get(bias)
    return data, None


@dataclass(frozen=True)
class Policy:
    """A policy to evaluate: code, or the weights of a linear policy, plus files.

    - Code (:meth:`from_code`, :meth:`from_file` of a ``.py``): a module defining
      ``act(obs)`` (or ``choose_action(obs)``) that returns an action. It runs in the
      sandbox next to the environment; before each episode the runner seeds
      ``random`` (and numpy's global generator, if loaded) and the env's action space,
      and the module's global ``env`` is the environment. Extra ``files`` (a Q-table,
      a checkpoint) lie next to it: open them relative to ``__file__``.
    - Weights (:meth:`from_weights`, :meth:`from_file` of ``.npy``/``.json``/
      ``.pt``/``.pth``): a linear policy. A matrix ``W`` of shape
      ``(n_actions, obs_dim)`` (``nn.Linear``'s layout) and bias ``b`` pick
      ``argmax(W·obs + b)``; a vector ``w`` picks ``1 if w·obs + b > 0 else 0``.

    :attr:`hash` covers everything the sandbox gets, so it changes exactly when the
    policy does.
    """

    kind: str
    files: tuple[tuple[str, bytes], ...]
    label: str = "policy"
    _hash: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = hashlib.sha256(self.kind.encode())
        for name, content in sorted(self.files):
            h.update(b"\0" + name.encode() + b"\0" + hashlib.sha256(content).digest())
        object.__setattr__(self, "_hash", h.hexdigest())

    @property
    def hash(self) -> str:
        return self._hash

    @classmethod
    def from_code(
        cls, code: str, *, files: Mapping[str, bytes | str | Path] | None = None,
        label: str = "policy",
    ) -> Policy:
        """A policy module's source; ``files`` are placed next to it."""
        try:
            tree = ast.parse(code, filename=label)
        except SyntaxError as exc:
            raise InvalidArgument(
                f"policy {label!r} is not valid Python: {exc.msg} at line {exc.lineno}") from exc
        if not _defines_entrypoint(tree):
            raise InvalidArgument(
                f"policy {label!r} defines neither act(obs) nor choose_action(obs): "
                "define one that returns an action")
        extra = []
        for name, content in (files or {}).items():
            if not _FILE_NAME.fullmatch(name) or name in RESERVED_FILES:
                raise InvalidArgument(
                    f"policy file name {name!r}: use a plain file name (letters, digits, ._-), "
                    f"not one of {sorted(RESERVED_FILES)}")
            extra.append((name, _as_bytes(name, content)))
        return cls("code", ((CODE_FILE, code.encode()), *sorted(extra)), label)

    @classmethod
    def from_weights(cls, weights: Any, bias: Any = None, *, label: str = "linear") -> Policy:
        """A linear policy from an array (list, numpy, torch) or a weights file path."""
        if isinstance(weights, (str, Path)):
            path = Path(weights)
            if not path.is_file():
                raise InvalidArgument(f"no weights file {str(path)!r}")
            if path.suffix.lower() not in WEIGHT_SUFFIXES:
                raise InvalidArgument(
                    f"{path}: unknown weights format: use one of {', '.join(WEIGHT_SUFFIXES)}")
            weights, file_bias = _load_weights(path)
            bias = file_bias if bias is None else bias
            label = path.name if label == "linear" else label
        w = _matrix(weights, "policy weights")
        rows = len(w) if isinstance(w[0], list) else 1
        b = _matrix(bias, "policy bias") if bias is not None else [0.0] * rows
        if isinstance(b[0], list) or len(b) != rows:
            raise InvalidArgument(f"policy bias: expected {rows} number(s), got {bias!r}")
        body = json.dumps({"W": w, "b": b}, separators=(",", ":")).encode()
        return cls("linear", ((WEIGHTS_FILE, body),), label)

    @classmethod
    def from_file(cls, path: str | Path, *, files: Mapping[str, bytes | str | Path] | None = None) -> Policy:
        """A ``.py`` policy module or a weights file (see :meth:`from_weights`)."""
        path = Path(path)
        if not path.is_file():
            raise InvalidArgument(f"no policy file {str(path)!r}")
        if path.suffix == ".py":
            return cls.from_code(path.read_text(), files=files, label=path.name)
        if files:
            raise InvalidArgument("extra files go with a code policy, not with weights")
        return cls.from_weights(path)

    @classmethod
    def coerce(cls, policy: Policy | str | Path) -> Policy:
        """A :class:`Policy` from itself, a file path, or a code string."""
        if isinstance(policy, Policy):
            return policy
        if isinstance(policy, Path):
            return cls.from_file(policy)
        if isinstance(policy, str):
            looks_like_path = "\n" not in policy and policy.strip().endswith(
                (".py", *WEIGHT_SUFFIXES))
            return cls.from_file(policy) if looks_like_path else cls.from_code(policy)
        raise InvalidArgument(
            f"policy must be code (a string), a file path or corral.rl.Policy, got "
            f"{type(policy).__name__}")


@dataclass(frozen=True)
class EnvSpec:
    """The environment episodes run in: a gymnasium id (``gymnasium.make(id,
    **kwargs)``, image ``rl``) or corral's tic-tac-toe (``"tictactoe"``, image
    ``python``); ``max_steps`` truncates episodes."""

    id: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    image: str = GYMNASIUM_IMAGE
    max_steps: int | None = None

    @classmethod
    def coerce(
        cls, env: EnvSpec | str, *, kwargs: Mapping[str, Any] | None = None,
        image: str | None = None, max_steps: int | None = None,
    ) -> EnvSpec:
        if isinstance(env, EnvSpec):
            if kwargs or image or max_steps:
                raise InvalidArgument("give env options in the EnvSpec, not as well as it")
            return env
        if not isinstance(env, str) or not env.strip():
            raise InvalidArgument(f"env must be a gymnasium id like 'CartPole-v1' or 'tictactoe', got {env!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise InvalidArgument(f"max_steps must be a positive integer, got {max_steps!r}")
        kw = dict(kwargs or {})
        try:
            json.dumps(kw)
        except TypeError as exc:
            raise InvalidArgument(f"env kwargs must be JSON values (they go into the sandbox): {exc}") from exc
        tictactoe = env in TICTACTOE_ALIASES
        env_id = TICTACTOE_ID if tictactoe else env
        default_image = TICTACTOE_IMAGE if tictactoe else GYMNASIUM_IMAGE
        return cls(env_id, tuple(sorted(kw.items())), image or default_image, max_steps)

    @property
    def is_tictactoe(self) -> bool:
        return self.id == TICTACTOE_ID

    @property
    def return_bounds(self) -> tuple[float, float] | None:
        """The range an episode's return can take, if known: tic-tac-toe's
        ``(min(-1, illegal_move_reward), 1)``, and a few registered gymnasium envs
        (:data:`STEP_REWARD_BOUNDS`) made without keyword arguments; else ``None``."""
        if self.is_tictactoe:
            illegal = dict(self.kwargs).get("illegal_move_reward", -1.0)
            return (min(-1.0, float(illegal)), 1.0)
        known = STEP_REWARD_BOUNDS.get(self.id)
        if known is None or self.kwargs:
            return None
        low, high, steps = known
        steps = min(steps, self.max_steps or steps)
        return (min(0.0, low * steps), max(0.0, high * steps))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kwargs": dict(self.kwargs), "image": self.image,
                "max_steps": self.max_steps}

    def key(self) -> str:
        """Canonical text for the cache key."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def __str__(self) -> str:
        name = "tictactoe" if self.is_tictactoe else self.id
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{name}({args})" if args else name
