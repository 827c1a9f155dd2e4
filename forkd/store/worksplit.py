"""A layer's memory chunks split by a working set: a chunk that holds both pages of the
working set (the pages a child touched up to its first answer: engine/lazy/record.py) and
pages outside it becomes two chunks, the working set's pages and the rest. The image is
unchanged, page for page; only its chunks differ, so the layer gets a new manifest (same
config, disk map, files and parent). A lazy fork's working set (docs/engine.md, "Lazy fork")
is then the chunks of the touched pages alone, where 2 MiB regions carried every untouched
page next to each touched one: 9.6 of 28.7 MiB for langgraph-react (2026-12-06).

Chunks that lie wholly inside or wholly outside the working set keep their blobs; only
split chunks are compressed anew, at the level of the layer's kind (docs/pack-format.md,
"Chunking"). The pages are the guest's choice, so the split is bounded: a chunk is split
only while the map stays within ``MAX_SPLIT_EXTENTS`` extents (half the format's bound);
each split adds one chunk at most, so the chunk count at most doubles.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

from forkd.errors import InvalidInput
from forkd.names import parse_ref
from forkd.pack import mediatypes as mt
from forkd.pack.chunking import RawChunk, build_map, unpack_chunk
from forkd.pack.imagemap import MAX_MAP_EXTENTS, PAGE_SIZE, ChunkRef, ImageMap, runs
from forkd.store.assembly import cache_of
from forkd.store.compaction import share_cache
from forkd.store.manifests import write_manifest

if TYPE_CHECKING:
    from forkd.store.store import Store

# write_manifest sets these from the config; every other annotation is carried over
MAX_SPLIT_EXTENTS = MAX_MAP_EXTENTS // 2  # a split map's extents: room left for the rest
_DERIVED = (mt.ANNOTATION_CREATED, mt.ANNOTATION_PARENT_TAG)


def pages_of(chunk: ChunkRef) -> list[int]:
    """The image pages a chunk holds, in its order."""
    return [first + i for first, n in chunk.extents for i in range(n)]


def split_chunk(chunk: ChunkRef, data: bytes, touched: Collection[int]) -> list[RawChunk]:
    """``chunk``'s pages (``data``: its uncompressed bytes) as the chunk of its pages in
    ``touched`` and the chunk of the others; one chunk when all lie on one side."""
    pages = pages_of(chunk)
    sides: tuple[list[int], list[int]] = ([], [])  # (touched, the rest): indexes in chunk
    for i, page in enumerate(pages):
        sides[0 if page in touched else 1].append(i)
    out = []
    view = memoryview(data)
    for side in sides:
        if side:
            out.append(RawChunk(b"".join(view[i * PAGE_SIZE:(i + 1) * PAGE_SIZE] for i in side),
                                runs([pages[i] for i in side])))
    return out


def split_memory(store: Store, ref: str, touched: Collection[int]) -> str:
    """Tag ``ref`` moved to its layer with the memory chunks split by ``touched`` (image
    page indexes; those past the image are ignored); the layer's new manifest digest (the
    old one when no chunk needed splitting)."""
    tag = parse_ref(ref)
    digest = store.resolve(tag)
    manifest = store.manifest(digest)
    what = f"layer {digest}"
    imap = store.image_map(manifest, "memory", what)
    if imap is None:
        raise InvalidInput(f"{what} has no memory map; nothing to split")
    hot = frozenset(touched)
    mixed = _within_budget(imap, hot)
    if not mixed:
        return digest

    def split() -> Iterator[RawChunk]:  # only the chunks that straddle are read
        for chunk in mixed:
            data = unpack_chunk(store.blobs.read(chunk.digest, chunk.stored, f"{what} chunk"),
                                chunk, f"{what} chunk {chunk.digest}")
            yield from split_chunk(chunk, data, hot)

    with store.writing():
        cut = build_map(store.blobs, imap.kind, imap.size, split(), [])
        kept = tuple(c for c in imap.chunks if c not in mixed)
        new_map = ImageMap(imap.kind, imap.size, kept + cut.chunks, imap.zero)
        new_map.validate()
        disk_map = store.image_map(manifest, "disk", what)
        chain = store.chain(digest)
        annotations = {k: v for k, v in manifest.annotations.items() if k not in _DERIVED}
        new = write_manifest(store.blobs, store.config(digest), new_map, disk_map,
                             dict(manifest.files), chain[1] if len(chain) > 1 else None,
                             annotations)
        store.set_tag(tag, new, force=True)
    cached = cache_of(store, digest)
    images = {p.stem: p for p in cached.glob("*.img")} if cached.is_dir() else {}
    if images:
        share_cache(store, images, new)  # the same images by construction
    return new


def _within_budget(imap: ImageMap, hot: frozenset[int]) -> list[ChunkRef]:
    """The chunks to split: those that straddle the working set, in image order, as long
    as the split map stays within ``MAX_SPLIT_EXTENTS`` extents (the touched pages are the
    guest's choice: one touching every other page would cut each 2 MiB chunk into 512
    one-page extents, a map past the pack format's bounds, and the push would fail); the
    others are left whole (their untouched pages travel with the working set)."""
    budget = MAX_SPLIT_EXTENTS - imap.extent_count
    out = []
    for chunk in imap.chunks:
        if not _straddles(chunk, hot):
            continue
        pages = pages_of(chunk)
        sides = runs([p for p in pages if p in hot]), runs([p for p in pages if p not in hot])
        extra = len(sides[0]) + len(sides[1]) - len(chunk.extents)
        if extra <= budget:
            budget -= extra
            out.append(chunk)
    return out


def _straddles(chunk: ChunkRef, hot: frozenset[int]) -> bool:
    """Whether the chunk holds pages on both sides of the working set."""
    inside = [page in hot for page in pages_of(chunk)]
    return any(inside) and not all(inside)
