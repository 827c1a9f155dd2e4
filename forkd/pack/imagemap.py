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

Bounds (docs/pack-format.md): a map blob is at most ``MAX_MAP_BYTES`` and lists at
most ``MAX_MAP_EXTENTS`` extents (chunk extents plus zero extents); a chunk's stored size
is at most ``max_stored`` of its size (one zstd frame of it). Readers refuse a
descriptor over the byte bound before fetching or reading the blob, and count the
extents before building anything from them, so what parsing one map costs is bounded
whatever image size the map declares.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import IntegrityError
from forkd.pack import mediatypes as mt

MAP_VERSION = 1
PAGE_SIZE = 4096
CHUNK_PAGES = 512  # 2 MiB uncompressed: hugepage aligned
CHUNK_SIZE = CHUNK_PAGES * PAGE_SIZE
MAX_IMAGE_SIZE = 1 << 40  # 1 TiB
# The largest map of the benchmark's synthetic 1 GiB snapshots (bench/chain_assembly.py's
# images: 20% random, 10% repeated pages, scattered) is 782 KB with 69,524 extents (a diff
# changing half the pages). A 1 GiB image has 262,144 pages, so no map of it lists more
# extents; its worst map (every page its own extent) is 2.8 MB. The bounds admit every map
# of an image up to 1 GiB: 5x and 3.8x the largest measured.
MAX_MAP_BYTES = 4 << 20
MAX_MAP_EXTENTS = 1 << 18
MAP_MEDIA_TYPES = frozenset(map_type for map_type, _ in mt.IMAGE_ROLES.values())

Kind = Literal["flat", "diff"]
Extent = tuple[int, int]  # (first page, page count)


@dataclass(frozen=True)
class ChunkRef:
    digest: str
    blake3: str
    size: int
    stored: int
    extents: tuple[Extent, ...]

    @property
    def blob(self) -> tuple[str, str, int, int]:
        """What its digest names (its extents aside): two refs to one digest agree on it,
        else the maps naming them are corrupt or hostile."""
        return self.digest, self.blake3, self.size, self.stored


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

    @property
    def extent_count(self) -> int:
        return sum(len(c.extents) for c in self.chunks) + len(self.zero)

    def to_bytes(self) -> bytes:
        """The map's encoding; IntegrityError when it would exceed ``MAX_MAP_BYTES`` (no
        reader would accept it)."""
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
        data = json.dumps(doc, separators=(",", ":")).encode()
        check_map_size(len(data), "the new image map")
        return data

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "image map") -> ImageMap:
        """Parse and validate an untrusted map (bounded size and extent count, extents
        inside the image)."""
        check_map_size(len(data), what)
        try:
            raw = jsondoc.loads(data, what)
            if raw["version"] != MAP_VERSION or raw["page_size"] != PAGE_SIZE:
                raise IntegrityError(
                    f"{what}: version {raw['version']!r}/page size {raw['page_size']!r} "
                    f"unsupported (this forkd reads version {MAP_VERSION}, {PAGE_SIZE}-byte pages)"
                )
            _check_extent_count(
                sum(len(c["extents"]) for c in raw["chunks"]) + len(raw.get("zero", [])), what
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
        _check_extent_count(self.extent_count, what)
        spans: list[Extent] = list(self.zero)
        for c in self.chunks:
            pages = sum(n for _, n in c.extents)
            if not c.extents or pages > CHUNK_PAGES or c.size != pages * PAGE_SIZE:
                raise IntegrityError(
                    f"{what}: chunk {c.digest} declares {c.size} bytes for {pages} pages "
                    f"(at most {CHUNK_PAGES} pages of {PAGE_SIZE} bytes)"
                )
            if c.stored > max_stored(c.size):
                raise IntegrityError(
                    f"{what}: chunk {c.digest} declares {c.stored} stored bytes for {c.size} "
                    f"bytes of pages; one zstd frame of them takes at most "
                    f"{max_stored(c.size)} (corrupt or hostile pack)"
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


def max_stored(size: int) -> int:
    """The most bytes a chunk of ``size`` uncompressed bytes can be stored in: one zstd frame
    (zstd's compressBound, plus a frame header and checksum). A map declaring more is
    refused, so that what a reader fetches, stores and reads into memory for one chunk stays
    near its 2 MiB whatever a hostile map says."""
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small + 64


def check_map_size(size: int, what: str) -> None:
    """Refuse a map blob of ``size`` bytes over ``MAX_MAP_BYTES``: call it on a descriptor's
    size before fetching or reading the blob."""
    if size > MAX_MAP_BYTES:
        raise IntegrityError(
            f"{what} is {size} bytes, over the pack format's limit of {MAX_MAP_BYTES} bytes "
            "for an image map (docs/pack-format.md); an image whose map is that large is "
            "too big or too fragmented for pack format 1"
        )


def check_descriptor_sizes(doc: Mapping[str, Any]) -> None:
    """Refuse an OCI manifest document (parsed JSON, structure checked) whose forkd image
    map layers exceed ``MAX_MAP_BYTES``: what a registry checks when a manifest is pushed,
    before anything reads the map. Other layers and other artifacts are left alone."""
    layers = doc.get("layers")
    for i, layer in enumerate(layers if isinstance(layers, list) else []):
        if not isinstance(layer, Mapping) or layer.get("mediaType") not in MAP_MEDIA_TYPES:
            continue
        size = layer.get("size")
        if isinstance(size, int):
            check_map_size(size, f"layers[{i}] ({layer['mediaType']})")


def _check_extent_count(count: int, what: str) -> None:
    if count > MAX_MAP_EXTENTS:
        raise IntegrityError(
            f"{what} lists {count} extents, over the pack format's limit of "
            f"{MAX_MAP_EXTENTS} (docs/pack-format.md); an image with that many extents is "
            "too fragmented for pack format 1"
        )


def _int(value: object) -> int:
    if not jsondoc.is_integer(value, 0):
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
