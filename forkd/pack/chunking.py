"""Cutting images into page-granular chunks, compressing them, and reading them back.

* Flat layers: the image is read in 2 MiB aligned regions; all-zero regions
  are skipped, and a region's non-zero pages are packed into one chunk. Equal
  regions give equal chunks, so a compacted layer shares every unchanged
  region with its base (stored once).
* Diff layers: only pages that differ from the parent's assembled image are
  kept, packed 512 to a chunk; pages that became zero are listed, not stored.
* Every chunk is one independent zstd frame; decompression is bounded by the
  size the map declares, so a decompression bomb cannot allocate more.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import zstandard

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput
from forkd.pack.imagemap import (
    CHUNK_PAGES,
    CHUNK_SIZE,
    PAGE_SIZE,
    ChunkRef,
    Extent,
    ImageMap,
    runs,
)


class ChunkSink(Protocol):
    """Where chunks go: the one method of a blob store (``forkd.store.blobs.BlobStore``)
    that chunking needs, so the pack format does not depend on the store."""

    def put_bytes(self, data: bytes, expected: str | None = None) -> str: ...


# zstd levels (docs/pack-format.md, "Chunking"). Decompression runs at the same speed for
# every level; compression does not, so the strong level is spent once, on the flat layers a
# build publishes, and layers made while a sandbox waits (diffs, compaction) use the fast one.
ZSTD_LEVEL = 3  # diff layers and the regions a compaction writes anew
# 18, not 19: on a root disk's 2 MiB chunks 19 takes 30% more CPU (874 vs 670 ms a chunk)
# for 0.2% smaller chunks (486 vs 487 KiB); 17 is 16% faster again but 5% larger
ZSTD_LEVEL_FLAT = 18  # flat layers imported from whole images (forkd build's base layers)
COMPRESS_THREADS = os.cpu_count() or 2  # zstd releases the GIL: one chunk per core
ZERO_PAGE = bytes(PAGE_SIZE)
ZERO_REGION = bytes(CHUNK_SIZE)

Progress = Callable[[int], None]  # called with bytes processed since the last call


@dataclass
class RawChunk:
    data: bytes
    extents: list[Extent]


def compress(data: bytes, level: int = ZSTD_LEVEL) -> bytes:
    result: bytes = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)
    return result


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompression context. One context per chunk set up and first
    touched its tables for every chunk: a third of the decompression time here (91 MiB of
    python-numpy's memory chunks: 0.136 s with a new context each, 0.087 s reused). A
    context is not thread-safe, so each thread has its own."""
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def decompress(blob: bytes, expected_size: int, what: str) -> bytes:
    """Decompress one chunk, never producing more than ``expected_size`` bytes."""
    try:
        params = zstandard.get_frame_parameters(blob)
        if params.content_size not in (expected_size, zstandard.CONTENTSIZE_UNKNOWN):
            raise IntegrityError(
                f"{what}: frame declares {params.content_size} bytes, the map {expected_size}; "
                "refusing it (corrupt or hostile pack)"
            )
        data: bytes = _decompressor().decompress(blob, max_output_size=expected_size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: not a valid zstd chunk ({exc})") from exc
    if len(data) != expected_size:
        raise IntegrityError(f"{what}: decompressed to {len(data)} bytes, expected {expected_size}")
    return data


def unpack_chunk(blob: bytes, ref: ChunkRef, what: str) -> bytes:
    """A stored chunk's content: decompressed within its declared size and checked against
    the blake3 its map names (the one check of a chunk's content, for the store and the
    lazy path alike)."""
    data = decompress(blob, ref.size, what)
    dg.check(f"blake3:{ref.blake3}", f"blake3:{dg.blake3_of(data)}", what)
    return data


def _nonzero_pages(region: bytes, first_page: int) -> list[int]:
    mv = memoryview(region)
    return [
        first_page + i
        for i in range(len(region) // PAGE_SIZE)
        if mv[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] != ZERO_PAGE
    ]


def _pack(region: bytes, region_first: int, pages: list[int]) -> bytes:
    if len(pages) * PAGE_SIZE == len(region):
        return region
    mv = memoryview(region)
    return b"".join(
        mv[(p - region_first) * PAGE_SIZE : (p - region_first + 1) * PAGE_SIZE] for p in pages
    )


def image_size(f: BinaryIO, what: str) -> int:
    size = os.fstat(f.fileno()).st_size
    if size <= 0 or size % PAGE_SIZE:
        raise InvalidInput(
            f"{what} is {size} bytes; an image must be a non-empty multiple of {PAGE_SIZE} bytes"
        )
    return size


def flat_chunks(
    f: BinaryIO,
    size: int,
    progress: Progress | None = None,
    written: Iterable[Extent] | None = None,
) -> Iterator[RawChunk]:
    """Chunks of a whole image: per 2 MiB region, its non-zero pages. ``written`` (page
    extents, sorted, disjoint) reads only those pages: the caller knows the rest is zero."""
    if written is not None:
        yield from _written_chunks(f, written)
        return
    f.seek(0)
    for offset in range(0, size, CHUNK_SIZE):
        region = f.read(min(CHUNK_SIZE, size - offset))
        if progress:
            progress(len(region))
        if region == ZERO_REGION[: len(region)]:
            continue
        first = offset // PAGE_SIZE
        pages = _nonzero_pages(region, first)
        yield RawChunk(_pack(region, first, pages), runs(pages))


def _written_chunks(f: BinaryIO, written: Iterable[Extent]) -> Iterator[RawChunk]:
    """What ``flat_chunks`` yields for an image that is zero outside ``written``, at the
    cost of the written pages alone (an assembled chain: its holes are never read)."""
    region = -1
    pages: list[int] = []
    data: list[bytes] = []
    for first, n in written:
        while n:  # one 2 MiB region at a time
            count = min(n, CHUNK_PAGES - first % CHUNK_PAGES)
            if first // CHUNK_PAGES != region:
                if data:
                    yield RawChunk(b"".join(data), runs(pages))
                region, pages, data = first // CHUNK_PAGES, [], []
            block = memoryview(os.pread(f.fileno(), count * PAGE_SIZE, first * PAGE_SIZE))
            for i in range(count):
                page = block[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
                if page != ZERO_PAGE:
                    pages.append(first + i)
                    data.append(bytes(page))
            first, n = first + count, n - count
    if data:
        yield RawChunk(b"".join(data), runs(pages))


def diff_chunks(
    f: BinaryIO,
    parent: BinaryIO,
    size: int,
    zero: list[Extent],
    progress: Progress | None = None,
) -> Iterator[RawChunk]:
    """Chunks of the pages of ``f`` that differ from ``parent``; zeroed pages go to ``zero``."""
    f.seek(0)
    parent.seek(0)

    def changed() -> Iterator[tuple[int, bytes]]:
        for offset in range(0, size, CHUNK_SIZE):
            region = f.read(min(CHUNK_SIZE, size - offset))
            base = parent.read(len(region))
            if progress:
                progress(len(region))
            if region == base:
                continue
            mv, bv = memoryview(region), memoryview(base)
            first = offset // PAGE_SIZE
            for i in range(len(region) // PAGE_SIZE):
                page = mv[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
                if page != bv[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]:
                    yield first + i, bytes(page)

    yield from page_chunks(changed(), zero)


def page_chunks(pages: Iterable[tuple[int, bytes]], zero: list[Extent]) -> Iterator[RawChunk]:
    """Pack (page index, bytes) pairs, in increasing page order, 512 pages to a chunk."""
    zero_pages: list[int] = []
    batch: list[bytes] = []
    indexes: list[int] = []
    last = -1
    for index, page in pages:
        if index <= last:
            raise InvalidInput(f"pages must come in increasing order (page {index} after {last})")
        if len(page) != PAGE_SIZE:
            raise InvalidInput(f"page {index} is {len(page)} bytes, expected {PAGE_SIZE}")
        last = index
        if page == ZERO_PAGE:
            zero_pages.append(index)
            continue
        batch.append(page)
        indexes.append(index)
        if len(batch) == CHUNK_PAGES:
            yield RawChunk(b"".join(batch), runs(indexes))
            batch, indexes = [], []
    if batch:
        yield RawChunk(b"".join(batch), runs(indexes))
    zero.extend(runs(zero_pages))


def store_chunk(
    blobs: ChunkSink,
    raw: RawChunk,
    level: int = ZSTD_LEVEL,
    packed: bytes | None = None,
    blake3: str | None = None,
) -> ChunkRef:
    """Compress one chunk (unless ``packed`` is its frame already) and store it (once:
    equal chunks have equal digests). ``blake3``: the content's hash, when the caller has
    it already (chunk_key), so it is not computed twice."""
    if packed is None:
        packed = compress(raw.data, level)
    digest = blobs.put_bytes(packed, dg.of_bytes(packed))
    return ChunkRef(
        digest=digest,
        blake3=blake3 if blake3 is not None else dg.blake3_of(raw.data),
        size=len(raw.data),
        stored=len(packed),
        extents=tuple(raw.extents),
    )


ChunkKey = tuple[str, tuple[Extent, ...]]  # (blake3 of the uncompressed bytes, extents)


def chunk_key(raw: RawChunk) -> ChunkKey:
    """A chunk by content and place: what reuse and ready-made frames are looked up by."""
    return dg.blake3_of(raw.data), tuple(raw.extents)

PRECOMPRESS_MAX_BYTES = 256 << 20  # compressed frames a Precompressed holds at most


class Precompressed:
    """Chunks of an image compressed ahead of its import, by content and place: `forkd
    build` compresses the root disk on the core its template's TCG boot leaves idle; the
    disk the template leaves behind equals it in every region the guest did not write, and
    those regions are not compressed again. Holds compressed frames only, at most
    ``max_bytes`` of them (then it stops adding)."""

    def __init__(self, level: int, max_bytes: int = PRECOMPRESS_MAX_BYTES) -> None:
        self.level = level
        self.max_bytes = max_bytes
        self.held = 0
        self._frames: dict[ChunkKey, bytes] = {}

    def add_image(self, path: str, stop: Callable[[], bool]) -> None:
        """Compress the chunks of the image at ``path`` until done, full, or ``stop()``."""
        with open(path, "rb") as f:
            for raw in flat_chunks(f, image_size(f, path)):
                if stop() or self.held >= self.max_bytes:
                    return
                frame = compress(raw.data, self.level)
                self._frames[chunk_key(raw)] = frame
                self.held += len(frame)

    def frame(self, key: ChunkKey) -> bytes | None:
        return self._frames.get(key)


def known_chunks(maps: Iterable[ImageMap]) -> dict[ChunkKey, ChunkRef]:
    """The chunks of ``maps`` by content and place, for ``build_map(reuse=...)``."""
    return {(c.blake3, tuple(c.extents)): c for imap in maps for c in imap.chunks}


def build_map(
    blobs: ChunkSink,
    kind: str,
    size: int,
    chunks: Iterable[RawChunk],
    zero: list[Extent],
    level: int | None = None,
    reuse: Mapping[ChunkKey, ChunkRef] | None = None,
    ready: Precompressed | None = None,
) -> ImageMap:
    """Store every chunk and return the layer's image map (zero extents filled by ``chunks``).

    ``level`` defaults to ZSTD_LEVEL_FLAT for flat layers and ZSTD_LEVEL for diffs. A chunk
    whose bytes and extents equal one in ``reuse`` (chunks already in this store) is not
    compressed again: its stored blob serves, whatever level made it, so a compaction shares
    every unchanged region with its base. A chunk ``ready`` holds a frame of (at the level
    chosen) is stored from that frame, not compressed again."""
    chosen = level if level is not None else ZSTD_LEVEL_FLAT if kind == "flat" else ZSTD_LEVEL
    known = reuse or {}
    frames = ready if ready is not None and ready.level == chosen else None

    def one(raw: RawChunk) -> ChunkRef:
        if not known and frames is None:
            return store_chunk(blobs, raw, chosen)
        key = chunk_key(raw)
        hit = known.get(key)
        if hit is not None:
            return hit
        return store_chunk(blobs, raw, chosen, frames.frame(key) if frames else None, key[0])

    refs = tuple(_bounded_map(one, chunks, COMPRESS_THREADS))
    imap = ImageMap(
        kind="flat" if kind == "flat" else "diff", size=size, chunks=refs, zero=tuple(zero)
    )
    imap.validate()
    return imap


def _bounded_map(
    fn: Callable[[RawChunk], ChunkRef], items: Iterable[RawChunk], workers: int
) -> Iterator[ChunkRef]:
    """``fn`` over ``items`` in ``workers`` threads (zstd releases the GIL), results in order,
    at most 2 x workers chunks in flight (an image is never held in memory whole)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future[ChunkRef]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
