"""The local store: layers in, assembled images out.

Layout of ``$FORKD_HOME`` (default ``~/.local/share/forkd``; this module owns it)::

    blobs/sha256/ab/ab…   every blob: manifests, configs, maps, chunks, files (FsBlobStore)
    blobs/tmp/            in-flight blob writes
    tags.json             NAME:TAG → manifest digest (TagIndex, updated under tags.lock)
    gc.lock               writers hold it shared, gc holds it exclusive
    checked/              chunks whose content was checked (CheckedChunks: one empty file each)
    cache/<hex>/          assembled images of manifest <hex>: memory.img, disk.img (and, over
                          a backend that keeps no local files, the chain's vmstate, kernel, initrd)
    builds/<key>.json     the engine's build records: recipe content -> the snapshot it built
                          in this store (engine/build.py)

``Store`` is the facade: it holds the store's parts (blobs, tags, cache) and reads
manifests, configs and maps; each job is a module of its own, which the facade's methods
call: ``imports`` (a layer in), ``assembly`` (images out), ``compaction``, ``tagging``
(tag, remove), ``listing`` (images, inspect), ``verify``, ``gc``. The blobs are any
``BlobStore`` (``forkd.store.blobs``: the filesystem; ``forkd.store.s3``: a bucket).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from forkd.errors import InvalidInput, NotFound
from forkd.names import Ref, parse_ref
from forkd.pack.chain import MAX_CHAIN_DEPTH, Link, walk
from forkd.pack.chunking import Precompressed, Progress
from forkd.pack.config import Compat, Provenance, SnapshotConfig
from forkd.pack.imagemap import ImageMap, check_map_size
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Manifest
from forkd.store import assembly, compaction, gc, imports, listing, tagging, verify
from forkd.store.assembly import Assembled
from forkd.store.blobs import BlobStore, FsBlobStore
from forkd.store.checks import CheckedChunks
from forkd.store.gc import mapped_dirs
from forkd.store.imports import MAX_FILE_BLOB, ImageSource
from forkd.store.listing import LayerInfo
from forkd.store.manifests import chain_files
from forkd.store.tags import TagIndex, flock

__all__ = [
    "DEFAULT_AUTO_COMPACT_DEPTH",
    "MAX_FILE_BLOB",
    "Assembled",
    "ImageSource",
    "LayerInfo",
    "Store",
    "chain_files",
    "default_home",
    "mapped_dirs",
]

DEFAULT_AUTO_COMPACT_DEPTH = 8


def default_home() -> Path:
    env = os.environ.get("FORKD_HOME")
    if env:
        return Path(env)
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "forkd"


def _auto_compact_depth(given: int | None) -> int:
    env_depth = os.environ.get("FORKD_AUTO_COMPACT_DEPTH")
    depth = given
    if depth is None:
        try:
            depth = int(env_depth) if env_depth else DEFAULT_AUTO_COMPACT_DEPTH
        except ValueError:
            raise InvalidInput(
                f"FORKD_AUTO_COMPACT_DEPTH={env_depth!r} is not an integer"
            ) from None
    if not 1 <= depth <= MAX_CHAIN_DEPTH:
        raise InvalidInput(f"auto-compaction depth {depth} must be between 1 and {MAX_CHAIN_DEPTH}")
    return depth


class Store:
    def __init__(
        self,
        home: Path,
        auto_compact_depth: int | None = None,
        blobs: BlobStore | None = None,
        max_written: int | None = None,
    ) -> None:
        """A store in ``home``; ``blobs`` puts its blobs elsewhere, on any backend (the hub's
        compaction works on the hub's own blob store this way, with tags and cache in a
        scratch ``home``). ``max_written`` bounds the bytes one assembled image may get
        written (its pages that chunks provide; holes are free): a chunk stores 2 MiB of a
        repeated byte in a few dozen bytes, so what a chain's blobs weigh does not bound
        what assembling it writes. None: no bound (a local store assembles what its user
        imported)."""
        self.home = home
        self.max_written = max_written
        # 0700: the blobs are snapshots' memory, with whatever the guests held in it
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.blobs: BlobStore = blobs or FsBlobStore(home / "blobs")
        self.tags = TagIndex(home / "tags.json")
        self.cache_dir = home / "cache"
        self.cache_dir.mkdir(exist_ok=True)
        self.builds_dir = home / "builds"
        self.gc_lock = home / "gc.lock"
        self.checked = CheckedChunks(home / "checked")
        self.auto_compact_depth = _auto_compact_depth(auto_compact_depth)
        self._manifests: dict[str, Manifest] = {}

    @classmethod
    def open(cls, home: Path | None = None) -> Store:
        return cls(home or default_home())

    # -- reading ------------------------------------------------------------
    def resolve(self, ref: str | Ref) -> str:
        key = str(parse_ref(str(ref)))
        digest = self.tags.read().get(key)
        if digest is None:
            raise NotFound(f"no tag {key} in {self.home}; `forkd images` lists the tags")
        return digest

    def manifest(self, digest: str) -> Manifest:
        if digest not in self._manifests:
            data = self.blobs.read(digest, MAX_MANIFEST_BYTES, "manifest")
            self._manifests[digest] = Manifest.from_bytes(data, f"manifest {digest}")
        return self._manifests[digest]

    def forget_manifests(self) -> None:
        """Drop the parsed-manifest cache (gc removed blobs it may hold)."""
        self._manifests.clear()

    def config(self, digest: str) -> SnapshotConfig:
        m = self.manifest(digest)
        return SnapshotConfig.from_bytes(
            self.blobs.read(m.config.digest, m.config.size, "config"), f"config of {digest}"
        )

    def image_map(self, manifest: Manifest, role: str, what: str) -> ImageMap | None:
        d = manifest.maps.get(role)
        if d is None:
            return None
        check_map_size(d.size, f"{what} {role} map")  # before reading what it declares
        imap = ImageMap.from_bytes(
            self.blobs.read(d.digest, d.size, f"{what} {role} map"), f"{what} {role} map"
        )
        manifest.check_map(role, imap, what)
        return imap

    def chain(self, digest: str, name: str = "") -> list[Link]:
        return walk(digest, self.manifest, MAX_CHAIN_DEPTH, name)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold off gc while blobs are written that no tag reaches yet."""
        with flock(self.gc_lock, exclusive=False):
            yield

    # -- the jobs (each in its own module) ------------------------------------
    def import_layer(
        self,
        ref: str,
        *,
        memory: Path,
        vmstate: Path | None = None,
        disk: Path | None = None,
        parent: str | None = None,
        compat: Compat | None = None,
        files: Mapping[str, Path] | None = None,
        description: str = "",
        recipe: dict[str, Any] | None = None,
        force: bool = False,
        progress: Progress | None = None,
        disk_ready: Precompressed | None = None,
    ) -> LayerInfo:
        """A layer from raw files; with ``parent`` only pages that differ are stored.
        ``disk_ready``: chunks of the disk compressed ahead (chunking.Precompressed)."""
        return imports.import_layer(
            self,
            imports.LayerSources(
                ref,
                ImageSource(path=memory),
                vmstate=vmstate,
                disk=ImageSource(path=disk, ready=disk_ready) if disk else None,
                parent=parent,
                compat=compat,
                files=dict(files or {}),
                description=description,
                recipe=recipe,
            ),
            force=force,
            progress=progress,
        )

    def import_pages(
        self,
        ref: str,
        *,
        parent: str,
        pages: Iterable[tuple[int, bytes]],
        vmstate: Path | None = None,
        disk: Path | None = None,
        compat: Compat | None = None,
        description: str = "",
        force: bool = False,
    ) -> LayerInfo:
        """A diff layer from changed pages (``(page index, 4096 bytes)``, increasing order)."""
        return imports.import_layer(
            self,
            imports.LayerSources(
                ref,
                ImageSource(pages=pages),
                vmstate=vmstate,
                disk=ImageSource(path=disk) if disk else None,
                parent=parent,
                compat=compat,
                description=description,
            ),
            force=force,
            progress=None,
        )

    def tag(self, ref: str, source: str, force: bool = False) -> str:
        """Point tag ``ref`` at what ``source`` (a tag or a manifest digest) names."""
        return tagging.tag(self, ref, source, force)

    def set_tag(self, ref: Ref, digest: str, force: bool) -> None:
        tagging.set_tag(self, ref, digest, force)

    def assemble(self, ref: str | Ref, progress: Progress | None = None) -> Assembled:
        ref = parse_ref(str(ref))
        return self.assemble_digest(self.resolve(ref), str(ref), progress)

    def assemble_digest(
        self, digest: str, name: str = "", progress: Progress | None = None
    ) -> Assembled:
        """Images of a chain head, from the cache or written once from the flattened maps."""
        return assembly.assemble(self, digest, name, progress)

    def compact(self, ref: str, to: str, force: bool = False) -> LayerInfo:
        return compaction.compact(self, ref, to, force)

    def compact_digest(self, digest: str, tag: str, provenance: Provenance) -> str:
        """Flatten the chain headed by manifest ``digest`` into one flat layer created under
        ``tag`` (``NAME:TAG``); write its blobs, set no tag, return its manifest digest.

        The caller holds ``writing()`` when a ``gc`` of this store may run meanwhile. The
        hub's server-side compaction calls this on a scratch store over the hub's blobs."""
        return compaction.flatten(self, digest, tag, provenance)

    def layer_info(self, ref: Ref, digest: str) -> LayerInfo:
        return listing.layer_info(self, ref, digest)

    def images(self) -> list[LayerInfo]:
        return listing.images(self)

    def inspect(self, ref: str) -> dict[str, Any]:
        return listing.inspect(self, ref)

    def dependents(self, ref: Ref) -> list[str]:
        return tagging.dependents(self, ref)

    def remove(self, ref: str, cascade: bool = False,
               refuse: Callable[[str], None] | None = None) -> list[str]:
        return tagging.remove(self, ref, cascade, refuse)

    def verify(self) -> list[str]:
        """Problems found re-reading everything: each blob's sha256, each tag's chain and maps."""
        return verify.problems(self)

    def gc(self, on_remove: Callable[[str, int], None] | None = None) -> tuple[int, int]:
        """Remove every blob and cached image no tag reaches; returns (blobs, bytes)."""
        return gc.collect(self, on_remove)
