"""Harbor environments on corral: ``CorralEnvironment`` implements Harbor's
``BaseEnvironment`` (tested with Harbor 0.26, which needs Python >= 3.12)::

    pip install harbor==0.26.0 corral
    CORRAL_URL=unix:///run/corral.sock \\
        harbor run -p path/to/task --agent oracle \\
        --env corral.integrations.harbor:CorralEnvironment

(``--env`` takes an import path in Harbor 0.26; older releases spelled it
``--environment-import-path``, which 0.26 still accepts, deprecated.)

``start`` builds the task's ``environment/Dockerfile`` with corral's Dockerfile builder
(:meth:`corral.AsyncImage.from_dockerfile`: each instruction a cached layer, ``FROM``
a registry image pulled once), or starts from the task's ``docker_image`` (a registry
reference), plus one layer that makes Harbor's directories (``/logs``, ``/tests``,
``/solution``) and the image's working directory writable; then it starts one sandbox
with the task's CPUs, memory and disk, and no network unless the task allows the
internet (then the host's: corral has no per-host allow-list). ``exec`` runs
``bash -c COMMAND`` with the task's env, a cwd and a timeout; files go up and down
through corral's file API.

Users: ``user=`` (and Harbor's ``default_user``) is honoured for ``root``/``0`` (root
of the sandbox's user namespace) and the sandbox user (``1000``, or a name the image's
``/etc/passwd`` gives one of these uids); without one a command runs as the image's
``USER``, else as the sandbox user (docs/users.md). Another uid is refused. Docker
Compose files and GPUs are not supported.

The daemon is the SDK's (``CORRAL_URL``, else an embedded one).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult  # type: ignore[import-not-found]
from harbor.environments.capabilities import (  # type: ignore[import-not-found]
    EnvironmentCapabilities,
)

from corral import AsyncImage, AsyncSandbox
from corral.errors import ExecTimeout

HARBOR_DIRS = ("/logs", "/logs/agent", "/logs/verifier", "/logs/artifacts", "/tests",
               "/solution", "/installed-agent")
SANDBOX_TIMEOUT_S = 6 * 3600.0
EXEC_TIMEOUT_S = 3600.0
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 2048
DEFAULT_DISK_MB = 10240
_SLUG_RE = re.compile(r"[^a-z0-9._-]+")


class CorralEnvironment(BaseEnvironment):  # type: ignore[misc]
    """A Harbor task's environment as one corral sandbox."""

    @staticmethod
    def type() -> str:
        return "corral"

    @property
    def capabilities(self) -> Any:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        if self.task_env_config.docker_image:
            return
        if not (Path(self.environment_dir) / "Dockerfile").is_file():
            raise FileNotFoundError(
                f"{self.environment_dir}/Dockerfile not found (and the task names no "
                "docker_image): corral builds the task's Dockerfile")

    # ------------------------------------------------------------------ lifecycle

    async def start(self, force_build: bool) -> None:
        image = await self._image()
        cfg = self.task_env_config
        self._sandbox = await AsyncSandbox.create(
            image=image.name,
            cpus=float(self._override_cpus or cfg.cpus or DEFAULT_CPUS),
            memory_mb=int(self._override_memory_mb or cfg.memory_mb or DEFAULT_MEMORY_MB),
            disk_mb=int(self._override_storage_mb or cfg.storage_mb or DEFAULT_DISK_MB),
            network="host" if cfg.allow_internet else "none",
            timeout=SANDBOX_TIMEOUT_S,
            tags=["harbor", f"harbor-session={self.session_id}"[:120]],
        )
        self._workdir = cfg.workdir or image.workdir or "/"

    async def _image(self) -> Any:
        """The task's image plus the layer Harbor's directories need (cached)."""
        cfg = self.task_env_config
        env_dir = Path(self.environment_dir)
        if cfg.docker_image:
            text = f"FROM {cfg.docker_image}\n"
            context = env_dir if env_dir.is_dir() else Path.cwd()
        else:
            text = (env_dir / "Dockerfile").read_text()
            context = env_dir
        dirs = " ".join(shlex.quote(d) for d in HARBOR_DIRS)
        text += ("\nUSER root\n"
                 f"RUN mkdir -p {dirs} && chmod 1777 {dirs} && "
                 '{ [ "$(pwd)" = / ] || chmod 1777 "$(pwd)"; }\n')
        digest = hashlib.sha256(f"{context.resolve()}\0{text}".encode()).hexdigest()[:8]
        slug = _SLUG_RE.sub("-", self.environment_name.lower()).strip("-._")[:40] or "task"
        with tempfile.TemporaryDirectory(prefix="corral-harbor-") as tmp:
            dockerfile = Path(tmp) / "Dockerfile"
            dockerfile.write_text(text)
            return await AsyncImage.from_dockerfile(
                context, dockerfile=dockerfile, name=f"harbor-{slug}-{digest}",
                on_event=self._log_build)

    def _log_build(self, event: Any) -> None:
        if event.type == "step":
            self.logger.debug(f"corral build step {event.step}/{event.total}: "
                              f"{event.instruction}{' (cached)' if event.cached else ''}")
        elif event.type == "log" and event.line:
            self.logger.debug(event.line)

    async def stop(self, delete: bool) -> None:
        sandbox = getattr(self, "_sandbox", None)
        if sandbox is not None:
            await sandbox.delete()
            self._sandbox = None

    # ------------------------------------------------------------------ commands

    async def exec(self, command: str, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout_sec: int | None = None,
                   user: str | int | None = None) -> Any:
        """``bash -c command`` in the sandbox, as ``user`` (else Harbor's default
        user, else the image's). A timeout gives return code 124, as ``timeout(1)``
        does."""
        merged = self._merge_env(env) or {}
        who = self._resolve_user(user)
        try:
            result = await self._sandbox.exec(
                ["bash", "-c", command], cwd=cwd or self._workdir, env=merged,
                timeout=float(timeout_sec) if timeout_sec else EXEC_TIMEOUT_S,
                user=None if who is None else str(who))
        except ExecTimeout as exc:
            return ExecResult(stdout="", stderr=str(exc), return_code=124)
        return ExecResult(stdout=result.stdout, stderr=result.stderr,
                          return_code=124 if result.timed_out else result.returncode)

    # ------------------------------------------------------------------ files

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        parent = str(PurePosixPath(target_path).parent)
        await self._sandbox.files.mkdir(parent, parents=True)
        await self._sandbox.files.write(target_path, source.read_bytes(),
                                        mode=source.stat().st_mode & 0o777)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        root = Path(source_dir)
        await self._sandbox.files.mkdir(target_dir, parents=True)
        for dirpath, dirnames, filenames in os.walk(root):
            rel = Path(dirpath).relative_to(root)
            here = str(PurePosixPath(target_dir) / rel.as_posix())
            for d in sorted(dirnames):
                await self._sandbox.files.mkdir(f"{here}/{d}", parents=True)
            for f in sorted(filenames):
                local = Path(dirpath) / f
                if local.is_file():
                    await self._sandbox.files.write(f"{here}/{f}", local.read_bytes(),
                                                    mode=local.stat().st_mode & 0o777)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(await self._sandbox.files.read(source_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        pending = [(source_dir, Path(target_dir))]
        while pending:  # iterative: a deep tree is no recursion
            remote, local = pending.pop()
            local.mkdir(parents=True, exist_ok=True)
            for entry in await self._sandbox.files.list(remote):
                if entry.is_symlink:
                    continue
                if entry.is_dir:
                    pending.append((entry.path, local / entry.name))
                else:
                    (local / entry.name).write_bytes(await self._sandbox.files.read(entry.path))
