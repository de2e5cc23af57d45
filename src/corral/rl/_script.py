"""Episodes as scripts: run a Python script in the sandbox, read the JSON record it
prints, and turn its failures into results (:class:`EpisodeError`,
:class:`EpisodeTimeout`) that the runner records and never retries."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import corral

DEFAULT_EPISODE_TIMEOUT_S = 300.0


class EpisodeError(Exception):
    """Raised by an episode (or :class:`ScriptEpisode`) whose policy failed: the
    episode is recorded ``error`` with this message, and not retried."""


class EpisodeTimeout(EpisodeError, TimeoutError):
    """An episode's command ran out of time: recorded ``timeout``, not retried."""


def parse_json_line(stdout: str) -> Any:
    """The last line of ``stdout`` that is a JSON object (an episode script's record);
    :class:`EpisodeError` if there is none."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    tail = stdout.strip()[-200:]
    raise EpisodeError(f"the episode printed no JSON record (stdout ends: {tail!r})")





class ScriptEpisode:
    """An episode that runs a Python script in the sandbox and parses its JSON record.

    ``script`` is the script's source (or a local :class:`~pathlib.Path`), written to
    ``path`` before each run; leave it ``None`` when the sandbox already has it (a
    snapshot made with it). It runs as ``python3 PATH SEED`` (``argv``, with
    ``{seed}`` and ``{path}`` filled in), with ``CORRAL_SEED`` set, and must print a
    JSON object as its last JSON line. A non-zero exit, an out-of-memory kill or no
    record raises :class:`EpisodeError`; running past ``timeout``,
    :class:`EpisodeTimeout`::

        episode = corral.rl.ScriptEpisode('''
        import json, sys
        seed = int(sys.argv[1])
        print(json.dumps({"reward": seed % 2, "steps": 1}))
        ''')
        results = list(corral.rl.run_episodes(episode, range(10)))
    """

    def __init__(
        self,
        script: str | Path | None = None,
        *,
        path: str = "/workspace/episode.py",
        argv: list[str] | None = None,
        timeout: float | None = DEFAULT_EPISODE_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.source = Path(script).read_bytes() if isinstance(script, Path) else (
            script.encode() if isinstance(script, str) else None)
        self.path = path
        self.argv = list(argv or ["python3", "{path}", "{seed}"])
        self.timeout = timeout
        self.env = dict(env or {})

    def _command(self, seed: Any) -> tuple[list[str], dict[str, str]]:
        argv = [a.format(seed=seed, path=self.path) for a in self.argv]
        return argv, {**self.env, "CORRAL_SEED": str(seed)}

    @staticmethod
    def finish(result: corral.CommandResult) -> Any:
        """The record of a finished run, or the :class:`EpisodeError` it deserves."""
        if result.timed_out:
            raise EpisodeTimeout(f"the episode script ran past its {result.timeout} s timeout")
        if result.oom_killed:
            raise EpisodeError("the episode script was killed for exceeding the memory limit")
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or [""])[-1][:300]
            raise EpisodeError(f"the episode script exited with status {result.returncode}: {last}")
        return parse_json_line(result.stdout)

    def __call__(self, sb: corral.Sandbox, seed: Any) -> Any:
        if self.source is not None:
            sb.files.write(self.path, self.source)
        argv, env = self._command(seed)
        return self.finish(sb.exec(argv, timeout=self.timeout, env=env))

    async def arun(self, sb: corral.AsyncSandbox, seed: Any) -> Any:
        """:meth:`__call__` for an :class:`~corral.AsyncSandbox`."""
        if self.source is not None:
            await sb.files.write(self.path, self.source)
        argv, env = self._command(seed)
        return self.finish(await sb.exec(argv, timeout=self.timeout, env=env))
