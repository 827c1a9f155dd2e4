"""Pack layers written by hand (what a hostile or buggy pusher can send): any declared
image size, any chunks, any map bytes. Shared by the bounded-work tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from forkd import digest as dg
from forkd.pack import mediatypes as mt
from forkd.pack.chunking import compress
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import CHUNK_SIZE, PAGE_SIZE, ChunkRef, Extent, ImageMap
from forkd.pack.manifest import Descriptor, Manifest
from forkd.store.store import Store

TIB = 1 << 40


@dataclass
class Layer:
    """A layer's blobs (config, map, chunks) and its manifest."""

    digest: str
    manifest: bytes
    blobs: dict[str, bytes] = field(default_factory=dict)


def chunk(pages: list[Extent], fill: int) -> tuple[ChunkRef, bytes]:
    """A chunk giving the pages of ``pages`` (extents) the byte ``fill``; (ref, stored blob)."""
    count = sum(n for _, n in pages)
    data = bytes([fill]) * (count * PAGE_SIZE)
    blob = compress(data)
    ref = ChunkRef(dg.of_bytes(blob), dg.blake3_of(data), len(data), len(blob), tuple(pages))
    return ref, blob


def layer(
    tag: str,
    imap: ImageMap,
    chunks: dict[str, bytes] | None = None,
    parent: Layer | None = None,
    map_bytes: bytes | None = None,
) -> Layer:
    """A manifest for ``imap`` (or for ``map_bytes`` as its memory map, unchecked)."""
    chunks = chunks or {}
    cfg = SnapshotConfig(
        tag=tag,
        parent_tag=tag if parent else None,
        parent_digest=parent.digest if parent else None,
        depth=1 if parent else 0,
        memory_size=imap.size,
        disk_size=None,
        page_size=PAGE_SIZE,
        compat=None,
        created_at="2026-01-01T00:00:00Z",
    )
    config = cfg.to_bytes()
    raw_map = map_bytes if map_bytes is not None else imap.to_bytes()
    blobs = {dg.of_bytes(config): config, dg.of_bytes(raw_map): raw_map, **chunks}
    manifest = Manifest(
        config=Descriptor(mt.CONFIG, dg.of_bytes(config), len(config)),
        maps={"memory": Descriptor(mt.MEMORY_MAP, dg.of_bytes(raw_map), len(raw_map))},
        chunks=tuple(Descriptor(mt.MEMORY_CHUNK, c.digest, c.stored) for c in imap.chunks),
        files={},
        subject=(
            Descriptor(mt.OCI_MANIFEST, parent.digest, len(parent.manifest)) if parent else None
        ),
        annotations={mt.ANNOTATION_PARENT_TAG: tag} if parent else {},
    )
    body = manifest.to_bytes()
    return Layer(dg.of_bytes(body), body, blobs)


def empty_tib(tag: str) -> Layer:
    """The 377-byte kind of pack: a flat map declaring the format's maximum, no chunks."""
    return layer(tag, ImageMap("flat", TIB, ()))


def sparse_tib_chain(tag: str) -> tuple[Layer, Layer]:
    """A 1 TiB flat base with one chunk at each end, and a diff that zeroes almost all of
    it (one zero extent) and writes one page in the middle: (base, diff)."""
    pages = TIB // PAGE_SIZE
    first, first_blob = chunk([(0, 4)], 1)
    last, last_blob = chunk([(pages - 512, 512)], 2)
    base = layer(
        tag,
        ImageMap("flat", TIB, (first, last)),
        {first.digest: first_blob, last.digest: last_blob},
    )
    middle, middle_blob = chunk([(pages // 2, 1)], 3)
    diff = layer(
        tag,
        ImageMap("diff", TIB, (middle,), zero=((2, pages // 2 - 2),)),
        {middle.digest: middle_blob},
        parent=base,
    )
    return base, diff


def repeated_memory(home: Path, tag: str, count: int) -> Store:
    """A store at ``home`` whose ``tag`` is a memory image of ``count`` chunks, each 2 MiB
    of one repeated byte (stored in a few dozen bytes: what decodes to far more than it
    stores)."""
    image = home.parent / f"{home.name}-repeated.img"
    with image.open("wb") as f:
        for i in range(count):
            f.write(bytes([i + 1]) * CHUNK_SIZE)
    store = Store(home)
    store.import_layer(tag, memory=image)
    return store
