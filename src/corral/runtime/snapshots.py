"""Snapshots: set an environment up once in a sandbox, start many copies of it.

A snapshot is a chain of layers (:mod:`corral.runtime.layers`), top first, over an
image. Taking one copies the sandbox's writable layer while it runs, then freezes it
just long enough to copy again what changed meanwhile (:mod:`corral.runtime.precopy`),
and thaws it (the rest of the commit works on the copy); the new layer goes on top of the chain the
sandbox itself started from. A sandbox created from a snapshot mounts
``chain + [image]`` as its overlay lower layers and writes into a fresh upper of its
own, so copies never see each other's writes.

Commit, then settle: the commit returns once the copy is installed and listed; hashing
it (its content digest) and making it durable (``syncfs``) follow in the background
(:meth:`Snapshots.settled` waits). The digest is the store's reading of its own copy,
which no sandbox can write (its sandboxes mount it read-only as a lower layer), so
taking it later certifies the same bytes. Until then the layer's registry digest is
``pending:<boot id>``; what needs the real one waits for it: a check against it
(:meth:`Snapshots.verify`, a first use after a restart) and a peer fetching it
(:func:`corral.runtime.layer_fetch.describe`, refused while pending). A crash of the
daemon before it settled loses nothing: the next engine, in the same boot (the page
cache holds the copy), settles it at :meth:`Snapshots.open`; after a crash of the
machine, where its bytes may be torn, it and the snapshots over it are dropped, never
listed half written. ``CORRAL_SNAPSHOT_SETTLE=sync``: hash and sync within the commit.

Lifetimes: every layer's references (snapshots holding it + live sandboxes started
from them) are counted in the registry. Deleting a snapshot that sandboxes still use
hides it at once but keeps its layers until the last of them ends; a layer nothing
references is removed. Chains deeper than :data:`MAX_CHAIN_DEPTH` (or whose paths
would overflow overlay's one page of mount options) are squashed into one layer.

Example::

    base = await engine.create()
    await engine.exec(base.id, "pip install --no-index /workspace/pkg.whl")
    snap = await engine.snapshot(base.id, name="with-pkg")
    copies = [await engine.create(snapshot="with-pkg") for _ in range(100)]
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import re
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from corral.errors import (
    CapacityExceeded,
    CorralError,
    InternalError,
    InvalidArgument,
    InvalidState,
    QuotaExceeded,
    SnapshotNotFound,
    Unsupported,
)
from corral.runtime import precopy, rootfs
from corral.runtime.cgroups import Cgroup
from corral.runtime.images import Image, ImageStore
from corral.runtime.layers import PENDING, TREE, LayerStore, boot_id, settle_later
from corral.runtime.namespaces import pick
from corral.runtime.ownership import UNSET, OwnerArg, Owners
from corral.runtime.paths import Layout
from corral.runtime.registry import Registry, SnapshotRow
from corral.runtime.storage import room_above_reserve
from corral.runtime.treecopy import Budget
from corral.schema import DEFAULT_IMAGE, SandboxSpec, SnapshotInfo

log = logging.getLogger(__name__)

MAX_CHAIN_DEPTH = 16
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ID_PREFIX = "snap-"
# Fields a restore never inherits from the sandbox the snapshot was taken from.
_NOT_INHERITED = {"tags", "snapshot", "image", "secrets"}  # secrets are stored masked


def _new_id() -> str:
    return _ID_PREFIX + secrets.token_hex(6)


class Snapshots:
    """The snapshots of one engine. The engine calls it; see the module docstring."""

    def __init__(
        self, layout: Layout, registry: Registry, images: ImageStore, owners: Owners | None = None
    ) -> None:
        self.layout = layout
        self.owners = owners or Owners()  # another tenant's snapshot: as if none
        self.registry = registry
        self.images = images
        self.store = LayerStore(layout.layers_dir)
        self.max_depth = MAX_CHAIN_DEPTH
        self._lock = asyncio.Lock()  # installing layers and rows vs removing them
        self._checked: dict[str, asyncio.Future[bool]] = {}  # layer id -> verification
        self._settling: dict[str, asyncio.Task[None]] = {}  # layer id -> its settle
        # An owner's snapshot disk quota in bytes (None: none), set by the daemon
        # from its tenants' max_snapshot_mb; checked before a snapshot is committed.
        self.quota_of: Callable[[str | None], int | None] = lambda owner: None
        # What else of an owner's counts against it: its stopped sandboxes' kept files
        self.also_held: Callable[[str | None], int] = lambda owner: 0
        # Layers checked against an owner's quota and being installed (not yet rows):
        # a check meanwhile (a kept tree's, another snapshot's) counts them too
        self._installing: dict[int, tuple[str | None, dict[str, int]]] = {}
        self.last_frozen_s = 0.0  # how long the last snapshot kept its sandbox frozen
        self.last_recopied = 0  # entries it copied frozen (precopy.WHOLE: all of them)

    def open(self, users: dict[str, int] | None = None) -> list[str]:
        """Recount references after a restart (``users``: the sandboxes adopted from
        before, per snapshot) and remove what a crash left behind (half-built or
        half-removed layers), settle the layers a crash left pending (or drop them and
        their snapshots if the machine restarted since). Returns the names removed."""
        self._settle_left()
        self.registry.recount_snapshots(users)
        return self.store.open(self.registry.layer_ids())

    def _settle_left(self) -> None:
        boot = boot_id()
        for lid, digest in self.registry.pending_layers().items():
            if digest == PENDING + boot and self.store.path(lid).is_dir():
                try:
                    self.registry.settle_layer(lid, self.store.settle(lid))
                    continue
                except OSError as exc:
                    log.warning("layer %s could not be settled: %s", lid, exc)
            # the machine restarted before it was durable (or it is unreadable): it may
            # be torn, so neither it nor a snapshot over it is ever listed
            dropped = self.registry.drop_layer(lid)
            log.warning("unsettled layer %s dropped with the snapshots over it: %s", lid, dropped)

    # ---------------------------------------------------------------- taking

    def check_name(self, name: str | None, owner: str | None = None) -> None:
        """A valid name, free in ``owner``'s namespace (the snapshot's owner: that of
        the sandbox it is taken from; names are per owner, :mod:`.namespaces`)."""
        self.valid_name(name)
        taken = None if name is None else self._owned(name, owner)
        if taken is not None:  # only the owner's own: another tenant's name is free
            raise self._name_taken(name or "", taken.id)

    @staticmethod
    def valid_name(name: str | None) -> None:
        """:class:`InvalidArgument` unless ``name`` is None or a valid snapshot name."""
        if name is None:
            return
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.startswith(_ID_PREFIX):
            raise InvalidArgument(
                f"invalid snapshot name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit and not with {_ID_PREFIX!r}",
                details={"name": name},
            )

    async def stage(self, upper: Path, cgroup: Cgroup | None, *, source: str,
                    spec: SandboxSpec, ids: dict[int, int] | None = None) -> Path:
        """Copy the writable layer of the sandbox ``source`` as it is at one instant:
        its processes frozen for the delta of a precopy (:mod:`.precopy`) unless
        ``cgroup`` is None (already paused), within its own limits
        (``spec``'s ``disk_mb`` and ``inodes``: :class:`SnapshotTooLarge` beyond), its
        owners translated by ``ids`` (its uid to the canonical one)."""
        budget = Budget.for_spec(spec, f"sandbox {source}", sandbox_id=source)
        budget.room = room_above_reserve(self.store.root)  # a loop of them cannot fill the disk
        with _translated(source):
            return await asyncio.to_thread(self._stage_frozen, upper, cgroup, budget, ids)

    def _stage_frozen(self, upper: Path, cgroup: Cgroup | None, budget: Budget,
                      ids: dict[int, int] | None) -> Path:
        skip = (rootfs.AGENT_DIR,)
        writeback = not settle_later()  # a layer settled later is written back then
        if cgroup is None:  # paused: nothing changes under the copy
            self.last_frozen_s, self.last_recopied = 0.0, precopy.WHOLE
            return self.store.stage(upper, skip=skip, budget=budget, ids=ids,
                                    writeback=writeback)
        staged = precopy.stage_running(self.store, upper, cgroup, skip=skip, budget=budget,
                                       ids=ids, writeback=writeback)
        self.last_frozen_s, self.last_recopied = staged.frozen_s, staged.recopied
        return staged.tmp

    async def commit(
        self, staged: Path, *, name: str | None, spec: SandboxSpec, parent: str | None,
        source: str,
    ) -> SnapshotInfo:
        """Turn a staged copy of ``source``'s upper into a snapshot whose chain continues
        the one ``source`` started from (``parent``), squashed if it grows too deep."""
        # Called right after staging, with no await in between: ``source`` still holds
        # its reference on ``parent``. Take one of our own: the sandbox may end now.
        if parent is not None:
            self.registry.use_snapshot(parent, +1)
        try:
            with _translated(source):
                row = await self._commit(staged, name=name, spec=spec, parent=parent, source=source)
        finally:
            await self.release(parent)
        if row is None:  # the name was taken meanwhile: collect the layer made for it
            await self.gc()
            taken = self._owned(name or "", spec.tenant)
            raise self._name_taken(name or "", taken.id if taken else "?")
        return row.info()

    async def _commit(
        self, staged: Path, *, name: str | None, spec: SandboxSpec, parent: str | None,
        source: str,
    ) -> SnapshotRow | None:
        try:
            below: list[str] = []
            if parent:
                parent_row = self.registry.snapshot(parent, include_deleted=True)
                if parent_row is None:  # cannot be: commit() holds a reference on it
                    raise InternalError(
                        f"snapshot {parent} vanished while {source} was snapshotted"
                    )
                below = parent_row.layers
            image = self.images.get(spec.image)
            later = settle_later()
            if self._needs_squash(len(below) + 1, image):
                trees = [staged / TREE, *(self.store.path(i) for i in below)]
                squashed = await asyncio.to_thread(self.store.stage_squashed, trees)
                await asyncio.to_thread(self.store.discard, staged)
                staged, below, later = squashed, [], False
            sealed = None if later else await asyncio.to_thread(self.store.seal, staged)
        except BaseException:
            await asyncio.to_thread(self.store.discard, staged)
            raise
        if sealed is None:  # hashed and made durable after the commit returns
            return await self._install_unsealed(staged, name=name, spec=spec, below=below,
                                                image=image, source=source)
        async with self._lock:  # no gc between the layer's rename and its reference
            try:  # under the lock: two snapshots of one owner are counted one after the other
                sizes = self.registry.layer_rows(below)
                adding = {sealed.id: sealed.size_bytes,
                          **{i: sizes[i][1] for i in below if i in sizes}}
                self.check_quota(spec.tenant, adding)
                self._installing[id(sealed)] = (spec.tenant, adding)  # until its row is in
                layer, _ = await asyncio.to_thread(self.store.install, sealed)
            except BaseException:
                self._installing.pop(id(sealed), None)
                await asyncio.to_thread(self.store.discard, sealed.tmp)
                raise
            self._mark_checked(layer.id)
            # Layering a tree twice means what layering it once does: keep the top one
            # (overlayfs refuses a directory given twice).
            chain = [layer.id, *(i for i in below if i != layer.id)]
            sizes = self.registry.layer_rows(chain)
            row = SnapshotRow(
                id=_new_id(), name=name, image=image.name, image_digest=image.digest,
                layers=chain, created_at=time.time(),
                size_bytes=layer.size_bytes + sum(sizes[i][1] for i in chain[1:]),
                source_sandbox=source,
                spec=spec.model_copy(update={"snapshot": None, "image": image.name}),
            )
            try:
                self.registry.add_snapshot(row, (layer.id, layer.digest, layer.size_bytes))
            except sqlite3.IntegrityError:
                return None
            finally:
                self._installing.pop(id(sealed), None)
        return row

    async def _install_unsealed(self, staged: Path, *, name: str | None, spec: SandboxSpec,
                                below: builtins.list[str], image: Image,
                                source: str) -> SnapshotRow | None:
        """The commit's end when its layer settles later: install the copy under a new
        name, list the snapshot, and settle the layer in the background."""
        try:
            usage = await asyncio.to_thread(self.store.usage, staged)
        except BaseException:
            await asyncio.to_thread(self.store.discard, staged)
            raise
        layer = None
        async with self._lock:
            try:
                sizes = self.registry.layer_rows(below)
                adding = {staged.name: usage, **{i: sizes[i][1] for i in below if i in sizes}}
                self.check_quota(spec.tenant, adding)
                self._installing[id(staged)] = (spec.tenant, adding)  # until its row is in
                layer = await asyncio.to_thread(self.store.install_unsealed, staged, usage)
                new = SnapshotRow(
                    id=_new_id(), name=name, image=image.name, image_digest=image.digest,
                    layers=[layer.id, *below], created_at=time.time(),
                    size_bytes=sum(adding.values()), source_sandbox=source,
                    spec=spec.model_copy(update={"snapshot": None, "image": image.name}),
                )
                try:
                    self.registry.add_snapshot(new, (layer.id, layer.digest, layer.size_bytes))
                    row: SnapshotRow | None = new
                except sqlite3.IntegrityError:
                    row = None  # the name was taken meanwhile
            except BaseException:
                row = None
                raise
            finally:
                self._installing.pop(id(staged), None)
                if row is None:  # failed or refused: nothing of it stays
                    await asyncio.to_thread(self.store.discard, staged if layer is None else None)
                    if layer is not None:
                        await asyncio.to_thread(self.store.remove, layer.id)
            assert layer is not None and row is not None
            self._mark_checked(layer.id)  # its digest will be read from this very copy
            self._settling[layer.id] = asyncio.ensure_future(self._settle(layer.id))
        return row

    async def _settle(self, layer_id: str) -> None:
        try:
            try:
                digest = await asyncio.to_thread(self.store.settle, layer_id)
            except Exception as exc:  # removed meanwhile, or the disk failed it: stays pending
                if layer_id in self.registry.layer_rows([layer_id]):
                    log.warning("snapshot layer %s did not settle: %s", layer_id, exc)
                return
            async with self._lock:  # gc forgets a row under it: a layer removed stays removed
                self.registry.settle_layer(layer_id, digest)
        finally:  # settled() waits until the digest is recorded, not just computed
            self._settling.pop(layer_id, None)

    async def settled(self, layer_ids: Iterable[str] | None = None) -> None:
        """Until the given layers (all if None) are hashed, durable and recorded."""
        tasks = [t for lid, t in list(self._settling.items())
                 if layer_ids is None or lid in set(layer_ids)]
        if tasks:
            await asyncio.gather(*(asyncio.shield(t) for t in tasks), return_exceptions=True)

    def usage_bytes(self, owner: str | None) -> int:
        """What ``owner``'s snapshots hold on disk: each layer once, however many of its
        snapshots share it (layers shared with other owners count for each of them)."""
        return sum(self.registry.owner_layers(owner).values())

    def check_quota(self, owner: str | None, adding: dict[str, int]) -> None:
        """:class:`QuotaExceeded` if ``owner``'s snapshots with the layers ``adding``
        (``{id: size}``) would pass its snapshot disk quota (or it is full already)."""
        limit = self.quota_of(owner)
        if limit is None:
            return
        held = self.registry.owner_layers(owner)
        for who, layers in self._installing.values():
            if who == owner:
                held.update(layers)
        kept = self.also_held(owner)
        now, after = sum(held.values()) + kept, sum({**held, **adding}.values()) + kept
        if (adding and after > limit) or (not adding and now >= limit):
            mb = 1 << 20
            raise QuotaExceeded(
                f"tenant {owner!r} is over its max_snapshot_mb quota: the limit is "
                f"{limit / mb:g} MB, {now / mb:.3f} MB held by its snapshots and the kept "
                f"files of its stopped sandboxes, {(after - now) / mb:.3f} MB more asked: "
                "delete snapshots (their layers go once no sandbox uses them) or stopped "
                "sandboxes of this tenant, or ask the admin for a larger quota "
                "(corral token update --max-snapshot-mb)",
                details={"quota": "max_snapshot_mb", "limit": limit / mb, "used": now / mb,
                         "requested": (after - now) / mb, "tenant": owner},
            )

    def _needs_squash(self, depth: int, image: Image) -> bool:
        if depth > self.max_depth:
            return True
        return rootfs.overlay_data_len(depth + len(image.lowers)) > rootfs.MAX_MOUNT_DATA

    # ----------------------------------------------------------------- using

    def resolve(self, spec: SandboxSpec, *, owner: OwnerArg = UNSET) -> SandboxSpec:
        """The spec a sandbox made from ``spec`` gets, without taking a reference:
        ``spec`` itself without a snapshot (to size admission before creating)."""
        return self._resolve(spec, self.owners.of(owner))[0]

    def acquire(self, spec: SandboxSpec, *,
                owner: OwnerArg = UNSET) -> tuple[SandboxSpec, SnapshotRow | None]:
        """Resolve ``spec.snapshot`` as ``owner`` finds it and take a reference on it for
        a new sandbox; the spec returned names the snapshot by id, its image, and
        inherits the fields not given explicitly. Pair with :meth:`release`."""
        spec, row = self._resolve(spec, self.owners.of(owner))
        if row is not None:
            self.registry.use_snapshot(row.id, +1)
        return spec, row

    def _resolve(self, spec: SandboxSpec,
                 owner: OwnerArg) -> tuple[SandboxSpec, SnapshotRow | None]:
        if spec.snapshot is None:
            return spec, None
        row = self._find(spec.snapshot, owner)
        if spec.image not in (DEFAULT_IMAGE, row.image):
            raise InvalidArgument(
                f"snapshot {row.id} was taken on image {row.image!r}, not {spec.image!r}: "
                "leave image out to start from a snapshot",
                details={"snapshot_id": row.id, "image": spec.image},
            )
        inherited = row.spec.model_dump(exclude=_NOT_INHERITED)
        explicit = spec.model_dump(include=spec.model_fields_set - _NOT_INHERITED)
        spec = SandboxSpec.parse(
            {**inherited, **explicit, "tags": spec.tags, "secrets": spec.secrets,
             "image": row.image, "snapshot": row.id}
        )
        return spec, row

    async def release(self, row: SnapshotRow | str | None) -> None:
        """A sandbox started from a snapshot ended (or failed to start)."""
        if row is None:
            return
        if self.registry.use_snapshot(row if isinstance(row, str) else row.id, -1):
            await self.gc()

    async def lowers(self, row: SnapshotRow | None, image: Image) -> list[Path]:
        """The overlay lower layers of a new sandbox, checked: its snapshot's layers
        verified (once per engine), and the mount options within a page."""
        lowers = image.lowers  # a built image's layers, then its base's rootfs
        if row is not None:
            if image.digest != row.image_digest:
                raise InvalidState(
                    f"snapshot {row.id} was taken on image {row.image!r} before it was "
                    "rebuilt or replaced; its layers no longer fit: take the snapshot again",
                    details={"snapshot_id": row.id, "image": row.image},
                )
            await self._check(row)
            lowers = [self.store.path(i) for i in row.layers] + lowers
        if rootfs.overlay_data_len(len(lowers)) > rootfs.MAX_MOUNT_DATA:
            raise Unsupported(
                f"{len(lowers)} filesystem layers do not fit in overlayfs's mount options: "
                "build the image with fewer steps",
            )
        return lowers

    # -------------------------------------------------------------- managing

    def list(self, *, tag: str | None = None, owner: OwnerArg = UNSET) -> list[SnapshotInfo]:
        """``owner``'s snapshots, or those taken from a sandbox that had ``tag``."""
        acting = self.owners.of(owner)
        rows = self.registry.snapshots()
        return [row.info() for row in rows
                if (tag is None or tag in row.spec.tags) and self.owners.sees(row.spec, acting)]

    def get(self, ref: str, *, owner: OwnerArg = UNSET) -> SnapshotInfo:
        return self._find(ref, owner).info()

    def source_tags(self, ref: str, *, owner: OwnerArg = UNSET) -> builtins.list[str]:
        """The tags of the sandbox a snapshot was taken from (who it belongs to, for a
        front-end that scopes by tag); :class:`SnapshotNotFound` if there is none."""
        return list(self._find(ref, owner).spec.tags)

    async def delete(self, ref: str, *, owner: OwnerArg = UNSET) -> bool:
        """Delete ``owner``'s snapshot; its layers go once no sandbox started from it
        runs. Idempotent: False if there was none."""
        row = self.lookup(ref, owner=owner)
        if row is None:
            return False
        if self.registry.drop_snapshot(row.id):
            await self.gc()
        return True

    async def gc(self) -> builtins.list[str]:
        """Remove every layer nothing references; returns their ids."""
        removed = []
        async with self._lock:
            for layer_id in self.registry.unreferenced_layers():
                if self.registry.forget_layer(layer_id):
                    self._checked.pop(layer_id, None)
                    await asyncio.to_thread(self.store.remove, layer_id)
                    removed.append(layer_id)
        return removed

    async def verify(self, ref: str, *, owner: OwnerArg = UNSET) -> SnapshotInfo:
        """Re-read every layer of a snapshot against its checksum."""
        row = self._find(ref, owner)
        for layer_id in row.layers:
            self._checked.pop(layer_id, None)
        await self._check(row)
        return row.info()

    async def _check(self, row: SnapshotRow) -> None:
        # a layer to check against its digest: once it exists (a new one needs no check)
        await self.settled([i for i in row.layers if i not in self._checked])
        rows = self.registry.layer_rows(row.layers)
        for layer_id in row.layers:
            check = self._checked.get(layer_id)
            if check is None:  # one check per layer, however many sandboxes wait for it
                digest = rows.get(layer_id, ("?", 0))[0]
                check = asyncio.ensure_future(
                    asyncio.to_thread(self.store.verify, layer_id, digest)
                )
                self._checked[layer_id] = check
            if not await asyncio.shield(check):
                if self._checked.get(layer_id) is check:
                    del self._checked[layer_id]  # check again next time
                raise InvalidState(
                    f"snapshot {row.id}: layer {layer_id} does not match its checksum (its "
                    "files were changed or lost on disk): delete the snapshot and take it again",
                    details={"snapshot_id": row.id, "layer": layer_id},
                )

    def _mark_checked(self, layer_id: str) -> None:
        done = asyncio.get_running_loop().create_future()
        done.set_result(True)
        self._checked[layer_id] = done

    def lookup(self, ref: str, *, owner: OwnerArg = UNSET) -> SnapshotRow | None:
        """The snapshot with this id, or this name in ``owner``'s namespace
        (:func:`~corral.runtime.namespaces.pick`); None if the caller has none."""
        acting = self.owners.of(owner)
        row = self.registry.snapshot(ref)
        if row is not None and self.owners.sees(row.spec, acting):
            return row
        return pick("snapshot", ref, acting,
                    ((r.spec.tenant, r.id, r) for r in self.registry.named(ref)))

    def _owned(self, name: str, owner: str | None) -> SnapshotRow | None:
        """``owner``'s own snapshot named ``name``."""
        return next((r for r in self.registry.named(name) if (r.spec.tenant or None) == owner),
                    None)

    def _find(self, ref: str, owner: OwnerArg) -> SnapshotRow:
        row = self.lookup(ref, owner=owner) if isinstance(ref, str) else None
        if row is None:
            raise SnapshotNotFound(
                f"no snapshot {ref!r}: it never existed or was deleted "
                "(list snapshots to see what exists)",
                details={"snapshot": ref},
            )
        return row

    @staticmethod
    def _name_taken(name: str, owner: str) -> InvalidState:
        return InvalidState(
            f"a snapshot named {name!r} already exists ({owner}): delete it or choose "
            "another name",
            details={"name": name, "snapshot_id": owner},
        )


@contextlib.contextmanager
def _translated(sandbox_id: str) -> Iterator[None]:
    """The one place a failed snapshot's low-level error becomes a corral error."""
    try:
        yield
    except CorralError:
        raise
    except Exception as exc:
        raise _commit_error(sandbox_id, exc) from exc


def _commit_error(sandbox_id: str, exc: Exception) -> CorralError:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return CapacityExceeded(
            f"snapshot of sandbox {sandbox_id} failed: no space left for its layer in the "
            "state directory: delete snapshots you no longer need",
            details={"sandbox_id": sandbox_id},
        )
    return InternalError(
        f"snapshot of sandbox {sandbox_id} failed: {type(exc).__name__}: {exc}",
        details={"sandbox_id": sandbox_id},
    )
