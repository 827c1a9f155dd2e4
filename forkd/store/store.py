"""The local store: layers in, assembled images out.

Layout of ``$FORKD_HOME`` (default ``~/.local/share/forkd``; this module owns it)::

    blobs/sha256/ab/ab…   every blob: manifests, configs, maps, chunks, files (FsBlobStore)
    blobs/tmp/            in-flight blob writes
    tags.json             NAME:TAG → manifest digest (TagIndex, updated under tags.lock)
    gc.lock               writers hold it shared, gc holds it exclusive
    cache/<hex>/          assembled images of manifest <hex>: memory.img, disk.img
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from forkd import digest as dg
from forkd.errors import ChainError, Conflict, ForkdError, IntegrityError, InvalidInput, NotFound
from forkd.names import Ref, parse_ref
from forkd.pack import mediatypes as mt
from forkd.pack.chain import MAX_CHAIN_DEPTH, Link, flatten, walk, written_extents
from forkd.pack.chunking import (
    ZSTD_LEVEL,
    Progress,
    RawChunk,
    build_map,
    decompress,
    diff_chunks,
    flat_chunks,
    image_size,
    known_chunks,
    page_chunks,
)
from forkd.pack.config import Compat, Provenance, SnapshotConfig
from forkd.pack.imagemap import PAGE_SIZE, Extent, ImageMap, check_map_size
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Descriptor, Manifest
from forkd.store.blobs import FsBlobStore
from forkd.store.sizes import component_bytes
from forkd.store.tags import TagIndex, flock

DEFAULT_AUTO_COMPACT_DEPTH = 8
MAX_FILE_BLOB = 8 << 30


def default_home() -> Path:
    env = os.environ.get("FORKD_HOME")
    if env:
        return Path(env)
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "forkd"


@dataclass(frozen=True)
class LayerInfo:
    ref: str
    digest: str
    depth: int
    memory_size: int
    stored_bytes: int  # bytes of blobs this layer references (own maps, chunks, files)
    new_pages: int  # pages this layer provides (diff: changed pages)
    compacted: bool


@dataclass(frozen=True)
class Assembled:
    """A chain head's images, ready to map: treat every path as read-only."""

    digest: str
    config: SnapshotConfig
    memory: Path
    disk: Path | None
    vmstate: Path | None
    files: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageSource:
    """Where a new layer's bytes for one image come from: a whole file or changed pages."""

    path: Path | None = None
    pages: Iterable[tuple[int, bytes]] | None = None


class Store:
    def __init__(
        self,
        home: Path,
        auto_compact_depth: int | None = None,
        blobs: FsBlobStore | None = None,
        max_written: int | None = None,
    ) -> None:
        """A store in ``home``; ``blobs`` puts its blobs elsewhere (the hub's compaction works
        on the hub's own blob store this way, with tags and cache in a scratch ``home``).
        ``max_written`` bounds the bytes one assembled image may get written (its pages
        that chunks provide; holes are free): a chunk stores 2 MiB of a repeated byte in
        a few dozen bytes, so what a chain's blobs weigh does not bound what assembling it
        writes. None: no bound (a local store assembles what its user imported)."""
        self.home = home
        self.max_written = max_written
        home.mkdir(parents=True, exist_ok=True)
        self.blobs = blobs or FsBlobStore(home / "blobs")
        self.tags = TagIndex(home / "tags.json")
        self.cache_dir = home / "cache"
        self.cache_dir.mkdir(exist_ok=True)
        self._gc_lock = home / "gc.lock"
        env_depth = os.environ.get("FORKD_AUTO_COMPACT_DEPTH")
        if auto_compact_depth is None:
            try:
                auto_compact_depth = int(env_depth) if env_depth else DEFAULT_AUTO_COMPACT_DEPTH
            except ValueError:
                raise InvalidInput(
                    f"FORKD_AUTO_COMPACT_DEPTH={env_depth!r} is not an integer"
                ) from None
        if not 1 <= auto_compact_depth <= MAX_CHAIN_DEPTH:
            raise InvalidInput(
                f"auto-compaction depth {auto_compact_depth} must be between 1 and "
                f"{MAX_CHAIN_DEPTH}"
            )
        self.auto_compact_depth = auto_compact_depth
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

    # -- writing layers -----------------------------------------------------
    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold off gc while blobs are written that no tag reaches yet."""
        with flock(self._gc_lock, exclusive=False):
            yield

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
    ) -> LayerInfo:
        """A layer from raw files; with ``parent`` only pages that differ are stored."""
        return self._import(
            ref,
            ImageSource(path=memory),
            vmstate=vmstate,
            disk=ImageSource(path=disk) if disk else None,
            parent=parent,
            compat=compat,
            files=files or {},
            description=description,
            recipe=recipe,
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
        return self._import(
            ref,
            ImageSource(pages=pages),
            vmstate=vmstate,
            disk=ImageSource(path=disk) if disk else None,
            parent=parent,
            compat=compat,
            files={},
            description=description,
            recipe=None,
            force=force,
            progress=None,
        )

    def _import(
        self,
        ref: str,
        memory: ImageSource,
        *,
        vmstate: Path | None,
        disk: ImageSource | None,
        parent: str | None,
        compat: Compat | None,
        files: Mapping[str, Path],
        description: str,
        recipe: dict[str, Any] | None,
        force: bool,
        progress: Progress | None,
    ) -> LayerInfo:
        target = parse_ref(ref)
        parent_ref = parse_ref(parent) if parent else None
        if parent_ref == target:
            raise ChainError(f"{target} cannot be its own parent")
        for role in files:
            if role not in ("kernel", "initrd"):
                raise InvalidInput(f"unknown file role {role!r}: use kernel or initrd")
        if not force and str(target) in self.tags.read():
            raise Conflict(f"tag {target} exists; pick another tag or pass --force to replace it")
        with self.writing():
            parent_asm: Assembled | None = None
            parent_chain: list[Link] = []
            if parent_ref is not None:
                parent_digest = self.resolve(parent_ref)
                parent_chain = self.chain(parent_digest, str(parent_ref))
                if len(parent_chain) >= MAX_CHAIN_DEPTH:
                    raise ChainError(
                        f"{parent_ref} is already {len(parent_chain) - 1} layers deep, the cap is "
                        f"{MAX_CHAIN_DEPTH}; compact it first (forkd compact)"
                    )
                parent_asm = self.assemble(parent_ref)
            memory_map = self._image_map(
                "memory", memory, parent_asm.memory if parent_asm else None, progress
            )
            disk_map = None
            if disk is not None:
                disk_map = self._image_map(
                    "disk", disk, parent_asm.disk if parent_asm else None, progress
                )
            file_paths = dict(files)
            if vmstate is not None:
                file_paths["vmstate"] = vmstate
            file_descs = {role: self._put_file(role, p) for role, p in file_paths.items()}
            depth = len(parent_chain)
            parent_cfg = parent_asm.config if parent_asm else None
            cfg = SnapshotConfig(
                tag=str(target),
                parent_tag=str(parent_ref) if parent_ref else None,
                parent_digest=parent_chain[0].digest if parent_chain else None,
                depth=depth,
                memory_size=memory_map.size,
                disk_size=disk_map.size
                if disk_map
                else (parent_cfg.disk_size if parent_cfg else None),
                page_size=PAGE_SIZE,
                compat=compat or (parent_cfg.compat if parent_cfg else None),
                created_at=_now(),
                description=description,
                recipe=recipe,
            )
            digest = self._write_manifest(
                cfg, memory_map, disk_map, file_descs, parent_chain[0] if parent_chain else None
            )
            if depth > self.auto_compact_depth:
                assert parent_ref is not None and parent_cfg is not None
                provenance = Provenance(
                    str(parent_ref), parent_chain[0].digest, parent_cfg.depth, "auto-depth"
                )
                digest = self._compact(digest, str(target), provenance)
            self._set_tag(target, digest, force)
        return self._layer_info(target, digest)

    def _image_map(
        self,
        role: str,
        source: ImageSource,
        parent_image: Path | None,
        progress: Progress | None,
    ) -> ImageMap:
        zero: list[Extent] = []
        if source.pages is not None:
            if parent_image is None:
                raise InvalidInput("a layer made of pages needs a parent")
            size = parent_image.stat().st_size
            return build_map(self.blobs, "diff", size, page_chunks(source.pages, zero), zero)
        assert source.path is not None
        try:
            f = open(source.path, "rb")  # noqa: SIM115 - closed by the `with` below
        except OSError as exc:
            raise InvalidInput(f"cannot read {role} image {source.path}: {exc.strerror}") from None
        with f:
            size = image_size(f, f"{role} image {source.path}")
            chunks: Iterator[RawChunk]
            if parent_image is not None and parent_image.stat().st_size == size:
                with open(parent_image, "rb") as pf:
                    chunks = diff_chunks(f, pf, size, zero, progress)
                    return build_map(self.blobs, "diff", size, chunks, zero)
            if parent_image is not None and role == "memory":
                raise InvalidInput(
                    f"memory image {source.path} is {size} bytes but the parent's is "
                    f"{parent_image.stat().st_size}; a diff layer keeps the parent's memory size"
                )
            return build_map(self.blobs, "flat", size, flat_chunks(f, size, progress), zero)

    def _put_file(self, role: str, path: Path) -> Descriptor:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_FILE_BLOB:
                    raise InvalidInput(f"{role} file {path} is over {MAX_FILE_BLOB} bytes")
                digest = self.blobs.put_file(f)
        except OSError as exc:
            raise InvalidInput(f"cannot read {role} file {path}: {exc.strerror}") from None
        return Descriptor(mt.FILE_ROLES[role], digest, size)

    def _write_manifest(
        self,
        cfg: SnapshotConfig,
        memory_map: ImageMap,
        disk_map: ImageMap | None,
        files: dict[str, Descriptor],
        parent: Link | None,
        extra_annotations: dict[str, str] | None = None,
    ) -> str:
        config_bytes = cfg.to_bytes()
        config = Descriptor(mt.CONFIG, self.blobs.put_bytes(config_bytes), len(config_bytes))
        maps: dict[str, Descriptor] = {}
        chunks: list[Descriptor] = []
        seen: set[tuple[str, str]] = set()
        for role, imap in (("memory", memory_map), ("disk", disk_map)):
            if imap is None:
                continue
            data = imap.to_bytes()
            map_type, chunk_type = mt.IMAGE_ROLES[role]
            maps[role] = Descriptor(map_type, self.blobs.put_bytes(data), len(data))
            for c in imap.chunks:
                if (chunk_type, c.digest) not in seen:
                    seen.add((chunk_type, c.digest))
                    chunks.append(Descriptor(chunk_type, c.digest, c.stored))
        annotations = {mt.ANNOTATION_CREATED: cfg.created_at}
        subject = None
        if parent is not None:
            data = self.blobs.read(parent.digest, MAX_MANIFEST_BYTES, "manifest")
            subject = Descriptor(mt.OCI_MANIFEST, parent.digest, len(data))
            assert cfg.parent_tag is not None
            annotations[mt.ANNOTATION_PARENT_TAG] = cfg.parent_tag
        annotations.update(extra_annotations or {})
        manifest = Manifest(config, maps, tuple(chunks), files, subject, annotations)
        return self.blobs.put_bytes(manifest.to_bytes())

    def tag(self, ref: str, source: str, force: bool = False) -> str:
        """Point tag ``ref`` at what ``source`` (a tag or a manifest digest) names."""
        target = parse_ref(ref)
        digest = source if source.startswith("sha256:") else self.resolve(source)
        self.chain(dg.validate(digest), str(target))  # the manifest and its chain must be here
        if not force and self.tags.read().get(str(target), digest) != digest:
            raise Conflict(f"tag {target} exists; pick another tag or pass --force to replace it")
        self._set_tag(target, digest, force)
        return digest

    def _set_tag(self, ref: Ref, digest: str, force: bool) -> None:
        def change(tags: dict[str, str]) -> None:
            if not force and tags.get(str(ref), digest) != digest:
                raise Conflict(
                    f"tag {ref} was created meanwhile by another process; "
                    "pass --force to replace it"
                )
            tags[str(ref)] = digest

        self.tags.update(change)

    # -- assembly -----------------------------------------------------------
    def assemble(self, ref: str | Ref, progress: Progress | None = None) -> Assembled:
        ref = parse_ref(str(ref))
        return self.assemble_digest(self.resolve(ref), str(ref), progress)

    def assemble_digest(
        self, digest: str, name: str = "", progress: Progress | None = None
    ) -> Assembled:
        """Images of a chain head, from the cache or written once from the flattened maps."""
        name = name or digest
        chain = self.chain(digest, name)
        config = self.config(digest)
        files: dict[str, Path] = {}
        for role, d in chain_files(chain).items():
            files[role] = self.blobs.path(d.digest)
            if not files[role].is_file():
                raise NotFound(
                    f"{name}: the {role} blob {d.digest} is missing from the store; "
                    "pull or import the pack again"
                )
        cache = self.cache_dir / dg.hex_part(digest)
        images: dict[str, Path] = {}
        for role in ("memory", "disk"):
            if not any(role in link.manifest.maps for link in chain):
                continue
            target = cache / f"{role}.img"
            if not target.exists():
                maps = self._chain_maps(chain, role, name)
                self._write_image(chain, role, maps, target, name, progress)
            images[role] = target
        if "memory" not in images:
            raise IntegrityError(f"{name}: the chain provides no memory image")
        return Assembled(
            digest, config, images["memory"], images.get("disk"), files.pop("vmstate", None), files
        )

    def _chain_maps(self, chain: list[Link], role: str, name: str) -> list[ImageMap]:
        maps: list[ImageMap] = []
        for i, link in enumerate(chain):
            imap = self.image_map(link.manifest, role, f"{name} layer {i} ({link.digest})")
            if imap is None:
                if role == "memory":
                    raise IntegrityError(f"{name}: layer {i} ({link.digest}) has no memory map")
                continue
            maps.append(imap)
            if imap.kind == "flat":
                break
        return maps

    def _write_image(
        self,
        chain: list[Link],
        role: str,
        maps: list[ImageMap],
        target: Path,
        name: str,
        progress: Progress | None,
    ) -> None:
        plan = flatten(maps, f"{name} {role}")
        written = sum(p.count for _, pieces in plan for p in pieces) * PAGE_SIZE
        if self.max_written is not None and written > self.max_written:
            raise InvalidInput(
                f"{name}: its {role} image would get {written} bytes written, over the limit "
                f"of {self.max_written} bytes here; flatten it where it was made "
                "(forkd compact) and push the flat layer"
            )
        label: dict[str, str] = {}
        for i, link in reversed(list(enumerate(chain))):
            for d in link.manifest.chunks:
                label[d.digest] = f"layer {i} ({dg.short(link.digest)})"
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{role}-")
        try:
            os.ftruncate(fd, maps[0].size)

            def place(item: tuple[Any, list[Any]]) -> None:
                chunk, pieces = item
                what = f"{name}: {label.get(chunk.digest, 'a layer')}, {role} chunk {chunk.digest}"
                try:
                    blob = self.blobs.read(chunk.digest, chunk.stored, what)
                except NotFound:
                    raise  # missing, not corrupt: the message names the chunk and its layer
                except (ForkdError, OSError) as exc:
                    raise IntegrityError(f"{what}: {exc}") from exc
                data = memoryview(decompress(blob, chunk.size, what))
                for p in pieces:
                    os.pwrite(
                        fd,
                        data[p.chunk_page * PAGE_SIZE : (p.chunk_page + p.count) * PAGE_SIZE],
                        p.page * PAGE_SIZE,
                    )
                if progress:
                    progress(chunk.size)

            with ThreadPoolExecutor(max_workers=2) as pool:
                for _ in pool.map(place, plan):
                    pass
            os.fchmod(fd, 0o444)
            os.close(fd)
            fd = -1
            os.replace(tmp, target)
        finally:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- compaction ---------------------------------------------------------
    def compact(self, ref: str, to: str, force: bool = False) -> LayerInfo:
        source, target = parse_ref(ref), parse_ref(to)
        if not force and str(target) in self.tags.read():
            raise Conflict(f"tag {target} exists; pick another tag or pass --force")
        with self.writing():
            digest = self.resolve(source)
            cfg = self.config(digest)
            new = self.compact_digest(
                digest, str(target), Provenance(str(source), digest, cfg.depth, "manual")
            )
            self._set_tag(target, new, force)
        return self._layer_info(target, new)

    def compact_digest(self, digest: str, tag: str, provenance: Provenance) -> str:
        """Flatten the chain headed by manifest ``digest`` into one flat layer created under
        ``tag`` (``NAME:TAG``); write its blobs, set no tag, return its manifest digest.

        The caller holds ``writing()`` when a ``gc`` of this store may run meanwhile. The
        hub's server-side compaction calls this on a scratch store over the hub's blobs."""
        return self._compact(digest, tag, provenance)

    def _compact(self, digest: str, tag: str, provenance: Provenance) -> str:
        """One flat layer with the head's assembled bytes; returns its manifest digest.

        Only the pages some layer's chunk wrote are read back: the rest of the assembled
        image is holes (zero), so the work follows the stored chunks, not the image size
        the maps declare."""
        asm = self.assemble_digest(digest)
        chain = self.chain(digest)
        maps: dict[str, ImageMap] = {}
        for role, path in (("memory", asm.memory), ("disk", asm.disk)):
            if path is None:
                continue
            chain_maps = self._chain_maps(chain, role, digest)
            plan = flatten(chain_maps, f"{digest} {role}")
            with open(path, "rb") as f:
                size = image_size(f, f"assembled {role} image")
                chunks = flat_chunks(f, size, written=written_extents(plan))
                # unchanged regions keep their stored chunks; new ones get the fast level
                maps[role] = build_map(self.blobs, "flat", size, chunks, [], level=ZSTD_LEVEL,
                                       reuse=known_chunks(chain_maps))
        files = chain_files(chain)
        cfg = replace(
            asm.config,
            tag=tag,
            parent_tag=None,
            parent_digest=None,
            depth=0,
            created_at=_now(),
            compacted_from=provenance,
        )
        new = self._write_manifest(
            cfg,
            maps["memory"],
            maps.get("disk"),
            files,
            None,
            {mt.ANNOTATION_COMPACTED_FROM: f"{provenance.from_tag}@{provenance.from_digest}"},
        )
        # Same bytes by construction: the head's cached images serve the new digest too.
        new_cache = self.cache_dir / dg.hex_part(new)
        if not new_cache.exists():
            tmp = Path(tempfile.mkdtemp(dir=self.cache_dir, prefix=".link-"))
            for role, path in (("memory", asm.memory), ("disk", asm.disk)):
                if path is not None:
                    os.link(path, tmp / f"{role}.img")
            try:
                os.rename(tmp, new_cache)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        return new

    # -- listing ------------------------------------------------------------
    def _layer_info(self, ref: Ref, digest: str) -> LayerInfo:
        """What `images` lists; compacted: the layer's config records where it was flattened
        from (local, automatic or hub-side compaction; the config travels with push/pull)."""
        m = self.manifest(digest)
        cfg = self.config(digest)
        imap = self.image_map(m, "memory", str(ref))
        assert imap is not None
        return LayerInfo(
            str(ref),
            digest,
            cfg.depth,
            cfg.memory_size,
            sum(d.size for d in m.blobs()),
            imap.provided_pages,
            cfg.compacted_from is not None,
        )

    def images(self) -> list[LayerInfo]:
        return [
            self._layer_info(parse_ref(name), digest)
            for name, digest in sorted(self.tags.read().items())
        ]

    def inspect(self, ref: str) -> dict[str, Any]:
        key = parse_ref(ref)
        digest = self.resolve(key)
        chain = self.chain(digest, str(key))
        cfg = self.config(digest)
        unique: dict[str, int] = {}
        layers = []
        for i, link in enumerate(chain):
            link_cfg = self.config(link.digest)
            own = sum(d.size for d in link.manifest.blobs())
            for d in link.manifest.blobs():
                unique[d.digest] = d.size
            layers.append(
                {
                    "position": i,
                    "tag": link_cfg.tag,
                    "digest": link.digest,
                    "depth": link_cfg.depth,
                    "stored_bytes": own,
                }
            )
        logical = cfg.memory_size + (cfg.disk_size or 0)
        stored = sum(unique.values())
        m = chain[0].manifest
        return {
            "ref": str(key),
            "digest": digest,
            "config": json.loads(cfg.to_bytes()),
            "layers": [
                d.to_json() for d in [m.config, *m.maps.values(), *m.chunks, *m.files.values()]
            ],
            "chain": layers,
            "logical_bytes": logical,
            "stored_bytes": stored,
            "dedup_ratio": round(logical / stored, 2) if stored else None,
            "components": component_bytes(
                chain, cfg, lambda link, role: self.image_map(link.manifest, role, str(key))
            ),
        }

    # -- removal ------------------------------------------------------------
    def dependents(self, ref: Ref) -> list[str]:
        tags = self.tags.read()
        digest = tags.get(str(ref))
        out = []
        for name, head in tags.items():
            if name != str(ref) and any(link.digest == digest for link in self.chain(head, name)):
                out.append(name)
        return sorted(out)

    def remove(self, ref: str, cascade: bool = False) -> list[str]:
        key = parse_ref(ref)
        self.resolve(key)
        deps = self.dependents(key)
        if deps and not cascade:
            raise Conflict(
                f"{key} is the parent of {', '.join(deps)}; remove those first or pass --cascade"
            )
        gone = [str(key), *deps]

        def change(tags: dict[str, str]) -> None:
            for name in gone:
                tags.pop(name, None)

        self.tags.update(change)
        return gone

    def verify(self) -> list[str]:
        """Problems found re-reading everything: each blob's sha256, each tag's chain and maps."""
        problems: list[str] = []
        for digest in self.blobs.digests():
            try:
                with self.blobs.open(digest) as f:
                    dg.check(digest, dg.of_file(f), f"blob {digest}")
            except ForkdError as exc:
                problems.append(str(exc))
        for name, head in sorted(self.tags.read().items()):
            try:
                for i, link in enumerate(self.chain(head, name)):
                    self.config(link.digest)
                    for role in link.manifest.maps:
                        self.image_map(link.manifest, role, f"{name} layer {i}")
                    for d in link.manifest.blobs():
                        if not self.blobs.has(d.digest):
                            problems.append(f"{name} layer {i}: blob {d.digest} is missing")
            except ForkdError as exc:
                problems.append(f"{name}: {exc}")
        return problems

    def gc(self, on_remove: Callable[[str, int], None] | None = None) -> tuple[int, int]:
        """Remove every blob and cached image no tag reaches; returns (blobs, bytes)."""
        with flock(self._gc_lock, exclusive=True):
            reachable: set[str] = set()
            for name, head in self.tags.read().items():
                for link in self.chain(head, name):
                    reachable.add(link.digest)
                    reachable.update(d.digest for d in link.manifest.blobs())
            count = freed = 0
            for digest in list(self.blobs.digests()):
                if digest not in reachable:
                    size = self.blobs.size(digest)
                    self.blobs.delete(digest)
                    count, freed = count + 1, freed + size
                    if on_remove:
                        on_remove(digest, size)
            in_use = mapped_dirs(self.cache_dir)
            for entry in self.cache_dir.iterdir():
                if entry in in_use:
                    continue  # a running VM maps this image (its tag may be gone): keep it
                if entry.name.startswith(".") or f"sha256:{entry.name}" not in reachable:
                    shutil.rmtree(entry, ignore_errors=True)
            for entry in self.blobs.tmp.iterdir():  # no writer runs while we hold the lock
                entry.unlink(missing_ok=True)
            self._manifests.clear()
            return count, freed


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def mapped_dirs(root: Path) -> set[Path]:
    """Directories directly under ``root`` holding a file some process maps (/proc/*/maps)."""
    prefix = str(root.resolve()) + "/"
    found: set[Path] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for line in text.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(prefix):
                found.add(root / path[len(prefix) :].split("/", 1)[0])
    return found


def chain_files(chain: list[Link]) -> dict[str, Descriptor]:
    """The whole-file blobs (vmstate, kernel, initrd) of a chain: the newest layer's wins."""
    files: dict[str, Descriptor] = {}
    for link in reversed(chain):
        files.update(link.manifest.files)
    return files
