"""The evaluation runner's lean start (corral/rl/_eval_runner.py): a tic-tac-toe episode's
sandbox starts it once, so it imports neither ``json`` (which brings ``re``, ``enum``,
``functools``, ``collections``) nor ``hashlib`` (OpenSSL), and the env no ``functools``;
its own JSON and SHA-256 (``_json``'s and ``_sha256``'s C code) give ``json``'s bytes and
``hashlib``'s digests, so records and digests are unchanged. No sandbox needed."""

from __future__ import annotations

import hashlib
import json
import math
import random
import subprocess
import sys

import pytest

from corral.rl import EnvSpec, Policy, _eval_runner, evaluation
from corral.rl.envs import tictactoe

HEAVY = ("json", "hashlib", "functools", "re", "enum", "collections")


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randrange(-10**20, 10**20)
    if kind == 1:
        return rng.uniform(-1e6, 1e6) * 10.0 ** rng.randrange(-300, 300)
    if kind == 2:
        return rng.choice([None, True, False, 0.0, -0.0, 1e16, math.inf, -math.inf, math.nan])
    if kind == 3:
        return "".join(chr(rng.randrange(0, 0x2FFFF)) for _ in range(rng.randrange(6)))
    if kind == 4:
        return rng.choice(["", 'a"b', "\\", "\n\t\x00", "é", "\U0001F600"])
    if kind == 5:
        return rng.random()
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {str(_value(rng, depth + 1)): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return tuple(_value(rng, depth + 1) for _ in range(rng.randrange(3)))


@pytest.mark.parametrize("lean", [True, False], ids=["_json", "json fallback"])
def test_the_runners_json_and_sha256_are_the_standard_ones_byte_for_byte(lean, monkeypatch):
    assert _eval_runner._LEAN  # this CPython has the expected _json: the lean path runs
    monkeypatch.setattr(_eval_runner, "_LEAN", lean)
    rng = random.Random(30)
    for _ in range(3000):
        value = _value(rng)
        text = json.dumps(value)
        assert _eval_runner.dumps(value) == text
        assert json.dumps(_eval_runner.loads(text)) == json.dumps(json.loads(text))
    for bad in (object(), {1j: 1}, [{1, 2}]):
        with pytest.raises(TypeError) as lean:
            _eval_runner.dumps(bad)
        with pytest.raises(TypeError) as std:
            json.dumps(bad)
        assert str(lean.value) == str(std.value)
    with pytest.raises(ValueError):
        _eval_runner.loads('{"a": 1} trailing')
    data = b"seed:0"
    assert _eval_runner.sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_tictactoe_runner_starts_without_the_heavy_modules(tmp_path):
    ev = evaluation._Evaluation(
        Policy.from_code(tictactoe.GREEDY_POLICY), EnvSpec.coerce("tictactoe"), client=None,
        timeout=60, concurrency=1, retries=0, per_sandbox=1, sandbox={})
    for name, content in ev._files().items():
        (tmp_path / name).write_bytes(content)
    # -I -S: the runner's own imports, not the host's site hooks
    r = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", "runner.py", "run",
                        "0:0", "7:1"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    assert "tictactoe" in imported and "random" in imported  # the measurement saw imports
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["seed"], x["k"]) for x in records] == [(0, 0), (7, 1)]
    assert all(len(x["digest"]) == 16 and "error" not in x for x in records), records
