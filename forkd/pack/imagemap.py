"""The image map: which pages of a memory or disk image a layer provides, and where.

Encoding (JSON, media types ``…memory.map.v1+json`` / ``…disk.map.v1+json``)::

    {"version": 1, "kind": "flat" | "diff", "size": <bytes>, "page_size": 4096,
     "chunks": [{"digest": "sha256:…", "blake3": "<hex>", "size": <uncompressed bytes>,
                 "stored": <compressed bytes>, "extents": [[first_page, n_pages], …]}, …],
     "zero": [[first_page, n_pages], …]}

A chunk's uncompressed bytes are its extents' pages, packed in order. A
``flat`` layer defines the whole image: pages no chunk covers are zero. A
``diff`` layer defines only the pages it covers (``zero`` lists pages it sets
to zero); every other page comes from the parent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from forkd import digest as dg
from forkd.errors import IntegrityError

MAP_VERSION = 1
PAGE_SIZE = 4096
CHUNK_PAGES = 512  # 2 MiB uncompressed: hugepage aligned
CHUNK_SIZE = CHUNK_PAGES * PAGE_SIZE
MAX_IMAGE_SIZE = 1 << 40  # 1 TiB
MAX_MAP_BYTES = 64 << 20

Kind = Literal["flat", "diff"]
Extent = tuple[int, int]  # (first page, page count)


@dataclass(frozen=True)
class ChunkRef:
    digest: str
    blake3: str
    size: int
    stored: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class ImageMap:
    kind: Kind
    size: int
    chunks: tuple[ChunkRef, ...]
    zero: tuple[Extent, ...] = ()

    @property
    def pages(self) -> int:
        return self.size // PAGE_SIZE

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored for c in self.chunks)

    @property
    def provided_pages(self) -> int:
        return sum(n for c in self.chunks for _, n in c.extents)

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "version": MAP_VERSION,
            "kind": self.kind,
            "size": self.size,
            "page_size": PAGE_SIZE,
            "chunks": [
                {
                    "digest": c.digest,
                    "blake3": c.blake3,
                    "size": c.size,
                    "stored": c.stored,
                    "extents": [list(e) for e in c.extents],
                }
                for c in self.chunks
            ],
            "zero": [list(e) for e in self.zero],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "image map") -> ImageMap:
        """Parse and validate an untrusted map (bounded size, extents inside the image)."""
        if len(data) > MAX_MAP_BYTES:
            raise IntegrityError(f"{what} is {len(data)} bytes, over the {MAX_MAP_BYTES} limit")
        try:
            raw = json.loads(data)
            if raw["version"] != MAP_VERSION or raw["page_size"] != PAGE_SIZE:
                raise IntegrityError(
                    f"{what}: version {raw['version']!r}/page size {raw['page_size']!r} "
                    f"unsupported (this forkd reads version {MAP_VERSION}, {PAGE_SIZE}-byte pages)"
                )
            chunks = tuple(
                ChunkRef(
                    digest=dg.validate(c["digest"]),
                    blake3=dg.validate_blake3(c["blake3"]),
                    size=_int(c["size"]),
                    stored=_int(c["stored"]),
                    extents=tuple(_extent(e) for e in c["extents"]),
                )
                for c in raw["chunks"]
            )
            imap = cls(
                kind=raw["kind"],
                size=_int(raw["size"]),
                chunks=chunks,
                zero=tuple(_extent(e) for e in raw.get("zero", [])),
            )
        except IntegrityError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{what} is malformed: {exc!r}") from exc
        imap.validate(what)
        return imap

    def validate(self, what: str = "image map") -> None:
        if self.kind not in ("flat", "diff"):
            raise IntegrityError(f"{what}: unknown kind {self.kind!r}")
        if self.size <= 0 or self.size % PAGE_SIZE or self.size > MAX_IMAGE_SIZE:
            raise IntegrityError(
                f"{what}: size {self.size} must be a positive multiple of {PAGE_SIZE} "
                f"up to {MAX_IMAGE_SIZE}"
            )
        if self.kind == "flat" and self.zero:
            raise IntegrityError(f"{what}: a flat map cannot list zero extents")
        spans: list[Extent] = list(self.zero)
        for c in self.chunks:
            pages = sum(n for _, n in c.extents)
            if not c.extents or pages > CHUNK_PAGES or c.size != pages * PAGE_SIZE:
                raise IntegrityError(
                    f"{what}: chunk {c.digest} declares {c.size} bytes for {pages} pages "
                    f"(at most {CHUNK_PAGES} pages of {PAGE_SIZE} bytes)"
                )
            spans.extend(c.extents)
        spans.sort()
        end = 0
        for first, n in spans:
            if first < end:
                raise IntegrityError(f"{what}: page {first} is provided twice")
            end = first + n
        if end > self.pages:
            raise IntegrityError(
                f"{what}: extent ends at page {end}, past the image's {self.pages}"
            )


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise IntegrityError(f"expected a non-negative integer, got {value!r}")
    return value


def _extent(value: object) -> Extent:
    if not isinstance(value, list) or len(value) != 2:
        raise IntegrityError(f"extent must be [first_page, n_pages], got {value!r}")
    first, n = _int(value[0]), _int(value[1])
    if n == 0:
        raise IntegrityError("extent with zero pages")
    return (first, n)


def runs(pages: list[int]) -> list[Extent]:
    """Sorted page indexes → maximal (first, count) runs."""
    out: list[Extent] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out
