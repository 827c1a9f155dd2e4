"""A layer into the store: its images chunked (whole, or as a diff against its parent's
assembled images), its files stored as blobs, its config and manifest written, then tagged.
A chain deeper than the store's auto-compaction depth is flattened on the way in."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forkd.errors import ChainError, Conflict, InvalidInput
from forkd.names import Ref, parse_ref, validate_line
from forkd.pack import mediatypes as mt
from forkd.pack.chain import MAX_CHAIN_DEPTH, Link
from forkd.pack.chunking import (
    Precompressed,
    Progress,
    RawChunk,
    build_map,
    diff_chunks,
    flat_chunks,
    image_size,
    page_chunks,
)
from forkd.pack.config import Compat, Provenance, SnapshotConfig
from forkd.pack.imagemap import PAGE_SIZE, Extent, ImageMap
from forkd.pack.manifest import Descriptor
from forkd.store import compaction
from forkd.store.assembly import Assembled
from forkd.store.blobs import put_file
from forkd.store.listing import LayerInfo, layer_info
from forkd.store.manifests import now, write_manifest

if TYPE_CHECKING:
    from forkd.store.store import Store

MAX_FILE_BLOB = 8 << 30
FILE_ROLES = ("kernel", "initrd")


@dataclass(frozen=True)
class ImageSource:
    """Where a new layer's bytes for one image come from: a whole file or changed pages."""

    path: Path | None = None
    pages: Iterable[tuple[int, bytes]] | None = None
    ready: Precompressed | None = None  # chunks of a flat image compressed ahead


@dataclass(frozen=True)
class LayerSources:
    """Everything a new layer is made of, and what it is called."""

    ref: str
    memory: ImageSource
    vmstate: Path | None = None
    disk: ImageSource | None = None
    parent: str | None = None
    compat: Compat | None = None
    files: dict[str, Path] = field(default_factory=dict)
    description: str = ""
    recipe: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Parent:
    ref: Ref
    chain: list[Link]
    assembled: Assembled


def import_layer(
    store: Store, layer: LayerSources, *, force: bool, progress: Progress | None
) -> LayerInfo:
    target = parse_ref(layer.ref)
    parent_ref = parse_ref(layer.parent) if layer.parent else None
    if parent_ref == target:
        raise ChainError(f"{target} cannot be its own parent")
    for role in layer.files:
        if role not in FILE_ROLES:
            raise InvalidInput(f"unknown file role {role!r}: use kernel or initrd")
    # the config holds it as one line (SnapshotConfig.validate): refused before any write
    validate_line(layer.description, "the layer's description")
    if not force and str(target) in store.tags.read():
        raise Conflict(f"tag {target} exists; pick another tag or pass --force to replace it")
    with store.writing():
        parent = _parent(store, parent_ref) if parent_ref is not None else None
        digest = _write_layer(store, layer, target, parent, progress)
        depth = len(parent.chain) if parent else 0
        if depth > store.auto_compact_depth:
            assert parent is not None
            provenance = Provenance(
                str(parent.ref), parent.chain[0].digest, parent.assembled.config.depth, "auto-depth"
            )
            digest = compaction.flatten(store, digest, str(target), provenance)
        store.set_tag(target, digest, force)
    return layer_info(store, target, digest)


def _parent(store: Store, ref: Ref) -> _Parent:
    chain = store.chain(store.resolve(ref), str(ref))
    if len(chain) >= MAX_CHAIN_DEPTH:
        raise ChainError(
            f"{ref} is already {len(chain) - 1} layers deep, the cap is "
            f"{MAX_CHAIN_DEPTH}; compact it first (forkd compact)"
        )
    return _Parent(ref, chain, store.assemble(ref))


def _write_layer(
    store: Store,
    layer: LayerSources,
    target: Ref,
    parent: _Parent | None,
    progress: Progress | None,
) -> str:
    """The layer's blobs and manifest; returns the manifest's digest."""
    asm = parent.assembled if parent else None
    memory_map = _image_map(store, "memory", layer.memory, asm.memory if asm else None, progress)
    disk_map = None
    if layer.disk is not None:
        disk_map = _image_map(store, "disk", layer.disk, asm.disk if asm else None, progress)
    file_paths = dict(layer.files)
    if layer.vmstate is not None:
        file_paths["vmstate"] = layer.vmstate
    file_descs = {role: _put_file(store, role, p) for role, p in file_paths.items()}
    parent_cfg = asm.config if asm else None
    cfg = SnapshotConfig(
        tag=str(target),
        parent_tag=str(parent.ref) if parent else None,
        parent_digest=parent.chain[0].digest if parent else None,
        depth=len(parent.chain) if parent else 0,
        memory_size=memory_map.size,
        disk_size=disk_map.size if disk_map else (parent_cfg.disk_size if parent_cfg else None),
        page_size=PAGE_SIZE,
        compat=layer.compat or (parent_cfg.compat if parent_cfg else None),
        created_at=now(),
        description=layer.description,
        recipe=layer.recipe,
    )
    return write_manifest(
        store.blobs, cfg, memory_map, disk_map, file_descs, parent.chain[0] if parent else None
    )


def _image_map(
    store: Store,
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
        return build_map(store.blobs, "diff", size, page_chunks(source.pages, zero), zero)
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
                return build_map(store.blobs, "diff", size, chunks, zero)
        if parent_image is not None and role == "memory":
            raise InvalidInput(
                f"memory image {source.path} is {size} bytes but the parent's is "
                f"{parent_image.stat().st_size}; a diff layer keeps the parent's memory size"
            )
        return build_map(
            store.blobs, "flat", size, flat_chunks(f, size, progress), zero, ready=source.ready
        )


def _put_file(store: Store, role: str, path: Path) -> Descriptor:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BLOB:
                raise InvalidInput(f"{role} file {path} is over {MAX_FILE_BLOB} bytes")
            digest = put_file(store.blobs, f)
    except OSError as exc:
        raise InvalidInput(f"cannot read {role} file {path}: {exc.strerror}") from None
    return Descriptor(mt.FILE_ROLES[role], digest, size)
