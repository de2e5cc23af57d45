# Generated from _async/_image.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""Images on the daemon: list them, build them from a spec, import archives, delete."""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable
from typing import Any

from typing_extensions import Self  # typing's since 3.11 only

from corral.client._sync._client import Client
from corral.client._backends import SyncBackend
from corral.client._build import TAR, load_spec, pack_build, pack_dockerfile, read_archive
from corral.errors import DaemonUnavailable, ImageImportError, error_from_dict
from corral.image_schema import (
    UPLOADED_ARCHIVE,
    BuildEvent,
    BuildSpec,
    BuildStats,
    ImageInfo,
    PruneResult,
    PullEvent,
)


class Image:
    """An image on the daemon. Build one from a spec (a YAML file, a dict or a
    :class:`~corral.image_schema.BuildSpec`), then start sandboxes from it by name::

        img = Image.build("env.yaml")              # name: from the spec
        img = Image.build({"base": "python", "steps": [
            {"run": "pip install six==1.16.0"}, {"env": {"MODE": "fast"}}]}, name="six")
        img.build_stats.cached                                # steps whose layer was reused
        sb = Sandbox.create(image=img.name)

    Steps run in sandboxes on the daemon, with the network; sandboxes made from the
    image have none unless they ask. ``copy`` sources are read here and sent along
    (relative ones start at ``context``, default: the spec file's directory).
    """

    def __init__(self, info: ImageInfo, *, client: Client,
                 build_stats: BuildStats | None = None) -> None:
        self._info = info
        self._client = client
        self._build_stats = build_stats

    @classmethod
    def get(cls, name: str, *, client: Client | None = None) -> Self:
        """An image by name; :class:`~corral.errors.ImageNotFound` if there is none."""
        client = client or Client.default()
        response = client.call("get_image", {"name": name})
        return cls(ImageInfo.model_validate(response.json()), client=client)

    @classmethod
    def list(cls, *, client: Client | None = None) -> builtins.list[Self]:
        """Every image on the daemon, by name."""
        client = client or Client.default()
        response = client.call("list_images")
        return [cls(ImageInfo.model_validate(d), client=client)
                for d in response.json()["images"]]

    @classmethod
    def build(
        cls, spec: str | os.PathLike[str] | dict[str, Any] | BuildSpec, *,
        name: str | None = None, context: str | os.PathLike[str] | None = None,
        on_event: Callable[[BuildEvent], Any] | None = None,
        client: Client | None = None,
    ) -> Self:
        """Build (or find cached) the image of ``spec``, named ``name`` or the spec's
        ``name``; an image of that name is replaced. ``on_event`` gets each step and
        output line as the build goes. A failed step raises
        :class:`~corral.errors.ImageBuildError` (``.step``, ``.output``)."""
        client = client or Client.default()
        parsed, ctx = SyncBackend.run_blocking(load_spec, spec, context)
        content_type, body = SyncBackend.run_blocking(pack_build, parsed, name, ctx)
        response = client.call(
            "build_image", content=body, headers={"Content-Type": content_type}, timeout=None,
            stream=True,
        )
        return cls._built(client, response, on_event)

    @classmethod
    def from_dockerfile(
        cls, context: str | os.PathLike[str], *, dockerfile: str | os.PathLike[str] | None = None,
        name: str | None = None, build_args: dict[str, str] | None = None,
        target: str | None = None, on_event: Callable[[BuildEvent], Any] | None = None,
        client: Client | None = None,
    ) -> Self:
        """Build a Dockerfile (default ``context/Dockerfile``) into the image ``name``
        (default: the context directory's name); the context goes to the daemon less
        what ``.dockerignore`` excludes. Each instruction is a cached step; ``FROM`` may
        name a registry image (pulled), a corral image or an earlier stage. What corral
        cannot build raises :class:`~corral.errors.DockerfileError` naming the line, a
        failed step :class:`~corral.errors.ImageBuildError`."""
        client = client or Client.default()
        content_type, body = SyncBackend.run_blocking(
            pack_dockerfile, context, dockerfile, name, build_args, target)
        response = client.call(
            "build_dockerfile_route", content=body, headers={"Content-Type": content_type},
            timeout=None, stream=True,
        )
        return cls._built(client, response, on_event)

    @classmethod
    def _built(cls, client: Client, response: Any,
                     on_event: Callable[[BuildEvent], Any] | None) -> Self:
        try:
            with client._errors():
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    event = BuildEvent.model_validate_json(line)
                    if event.type == "image" and event.image is not None:
                        return cls(event.image, client=client, build_stats=event.stats)
                    if event.type == "error":
                        raise error_from_dict(event.error or {})
                    if on_event is not None:
                        on_event(event)
        finally:
            response.close()
        raise DaemonUnavailable("the image build's log ended without a result (the daemon "
                                "may have stopped): build again, finished steps are cached")

    @classmethod
    def pull(
        cls, ref: str, *, name: str | None = None, insecure: bool = False,
        on_progress: Callable[[PullEvent], Any] | None = None,
        client: Client | None = None,
    ) -> Self:
        """Pull ``ref`` (``host[:port]/repo[:tag][@sha256:...]``) from its registry into
        the daemon's store, as ``name`` (default: derived from the reference; sandboxes
        may also name the reference itself as their image). Credentials are the
        daemon's (``REGISTRY_AUTH_FILE`` or ``~/.docker/config.json``). ``insecure``
        confirms plain HTTP (loopback registries, or those the daemon lists in
        ``CORRAL_INSECURE_REGISTRIES``). ``on_progress`` gets each layer's progress.
        Raises :class:`~corral.errors.RegistryAuthError`,
        :class:`~corral.errors.ImageNotFound` or :class:`~corral.errors.RegistryError`."""
        client = client or Client.default()
        response = client.call(
            "pull_image_route", json={"ref": ref, "name": name, "insecure": insecure},
            timeout=None, stream=True,
        )
        try:
            with client._errors():
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    event = PullEvent.model_validate_json(line)
                    if event.type == "image" and event.image is not None:
                        return cls(event.image, client=client)
                    if event.type == "error":
                        raise error_from_dict(event.error or {})
                    if on_progress is not None:
                        on_progress(event)
        finally:
            response.close()
        raise DaemonUnavailable("the pull's progress ended without a result (the daemon "
                                "may have stopped): pull again, it resumes")

    @classmethod
    def prune(cls, *, client: Client | None = None) -> PruneResult:
        """Delete the layers no image, build cache entry or sandbox holds (and stale
        partial downloads); what went and the bytes freed."""
        client = client or Client.default()
        response = client.call("prune_images", timeout=None)
        return PruneResult.model_validate(response.json())

    @classmethod
    def import_archive(
        cls, path: str | os.PathLike[str], *, name: str, client: Client | None = None,
    ) -> Self:
        """Import a ``docker save`` tarball, or an OCI image layout (a directory or its
        tar), as the image ``name`` (one of that name is replaced)."""
        client = client or Client.default()
        body = SyncBackend.run_blocking(read_archive, path)
        try:
            response = client.call(
                "import_image_route", params={"name": name}, content=body,
                headers={"Content-Type": TAR}, timeout=None,
            )
        except ImageImportError as exc:  # the daemon names the upload: name our file
            local = os.fspath(path)
            raise ImageImportError(
                exc.message.replace(UPLOADED_ARCHIVE, local), details={**exc.details, "path": local}
            ) from None
        return cls(ImageInfo.model_validate(response.json()), client=client)

    @property
    def info(self) -> ImageInfo:
        return self._info

    @property
    def name(self) -> str:
        return self._info.name

    @property
    def kind(self) -> str:
        return self._info.kind

    @property
    def digest(self) -> str:
        return self._info.digest

    @property
    def base(self) -> str | None:
        return self._info.base

    @property
    def layers(self) -> builtins.list[str]:
        return self._info.layers

    @property
    def env(self) -> dict[str, str]:
        return self._info.env

    @property
    def workdir(self) -> str | None:
        return self._info.workdir

    @property
    def size_bytes(self) -> int:
        return self._info.size_bytes

    @property
    def created_at(self) -> float:
        return self._info.created_at

    @property
    def build_stats(self) -> BuildStats | None:
        """What :meth:`build` did (steps cached and run), for an image it returned."""
        return self._build_stats

    @property
    def client(self) -> Client:
        return self._client

    def delete(self) -> None:
        """Delete the image (idempotent); :class:`~corral.errors.ImageInUse` while
        sandboxes, snapshots, pools or other images use it."""
        self._client.call("delete_image", {"name": self.name})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} kind={self.kind}>"
