"""An image's pages → the chunk pieces that provide them, from the chain's flattened maps
(``forkd.pack.chain.flatten``): what a lazy reader (the memory file, the disk export)
needs to produce any byte range without assembling the image.

``ImageLayout.read(offset, length)`` returns those bytes: pages no layer provides are
zero, the others are sliced from the chunks a ``ChunkSource`` gives. ``chunks_at`` names
the chunks a range touches (what a reader records for the prefetch).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from forkd.engine.lazy.chunks import ChunkSource
from forkd.errors import InvalidInput
from forkd.pack.chain import flatten
from forkd.pack.imagemap import PAGE_SIZE
from forkd.store.assembly import chain_maps


@dataclass(frozen=True)
class Segment:
    """Image pages [page, page + count) are pages [chunk_page, …) of chunk ``digest``."""

    page: int
    count: int
    digest: str
    chunk_page: int


class ImageLayout:
    """Where each page of the chain's ``role`` image comes from."""

    def __init__(self, source: ChunkSource, role: str) -> None:
        self.source = source
        self.role = role
        maps = chain_maps(source.store, source.chain, role, source.name)
        self.size = maps[0].size
        plan = flatten(maps, f"{source.name} {role}")
        segments = sorted((Segment(p.page, p.count, chunk.digest, p.chunk_page)
                           for chunk, pieces in plan for p in pieces), key=lambda s: s.page)
        self.segments = segments
        self._starts = [s.page for s in segments]
        # the chunks in image order (first touch of each): the prefetch's default order
        seen: dict[str, None] = {}
        for s in segments:
            seen.setdefault(s.digest)
        self.chunk_order = list(seen)
        self.by_chunk: dict[str, list[Segment]] = {}  # where each chunk's pages go
        for s in segments:
            self.by_chunk.setdefault(s.digest, []).append(s)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidInput(f"{self.source.name} {self.role}: range {offset}+{length} is "
                               f"outside the image's {self.size} bytes")

    def pieces(self, offset: int, length: int) -> list[tuple[int, int, Segment]]:
        """The segments a byte range overlaps: (byte offset in the range, bytes, segment)."""
        self._check(offset, length)
        end = offset + length
        first_page, last_page = offset // PAGE_SIZE, (end - 1) // PAGE_SIZE if length else -1
        out: list[tuple[int, int, Segment]] = []
        i = max(bisect.bisect_right(self._starts, first_page) - 1, 0)
        while i < len(self.segments) and self.segments[i].page <= last_page:
            s = self.segments[i]
            a = max(offset, s.page * PAGE_SIZE)
            b = min(end, (s.page + s.count) * PAGE_SIZE)
            if a < b:
                out.append((a - offset, b - a, s))
            i += 1
        return out

    def holes(self, offset: int, length: int) -> list[tuple[int, int]]:
        """The runs of a byte range that no layer provides (zeros): (byte offset in the
        image, bytes)."""
        out: list[tuple[int, int]] = []
        at = offset
        for start, n, _ in self.pieces(offset, length):
            if offset + start > at:
                out.append((at, offset + start - at))
            at = offset + start + n
        if offset + length > at:
            out.append((at, offset + length - at))
        return out

    def chunks_at(self, offset: int, length: int) -> list[str]:
        return list(dict.fromkeys(s.digest for _, _, s in self.pieces(offset, length)))

    def placed(self, digest: str, data: bytes) -> list[tuple[int, memoryview]]:
        """Chunk ``digest``'s uncompressed ``data`` as the image uses it: (byte offset in
        the image, the bytes there), one per segment (none when the image does not use
        the chunk)."""
        view = memoryview(data)
        return [(s.page * PAGE_SIZE,
                 view[s.chunk_page * PAGE_SIZE : (s.chunk_page + s.count) * PAGE_SIZE])
                for s in self.by_chunk.get(digest, [])]

    def read(self, offset: int, length: int) -> bytes:
        """The image's bytes [offset, offset + length): zeros where no layer provides."""
        out = bytearray(length)
        for at, n, s in self.pieces(offset, length):
            data = self.source.read(s.digest)
            start = s.chunk_page * PAGE_SIZE + (offset + at - s.page * PAGE_SIZE)
            out[at : at + n] = data[start : start + n]
        return bytes(out)
