"""Work per request follows what was stored, not what a map declares (issue 10 item 5).

Work is measured, never timed: bytes this process read (``rchar`` of /proc/self/io,
which counts reads of sparse files' holes too), blocks the assembled images allocate,
extents a plan lists. The timeout is only a safety net: without the bounds a 1 TiB
pack takes half an hour to compact.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hostile_packs import TIB, Layer, chunk, empty_tib, layer, sparse_tib_chain

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput
from forkd.pack import mediatypes as mt
from forkd.pack.chain import flatten, written_extents
from forkd.pack.chunking import flat_chunks
from forkd.pack.imagemap import (
    CHUNK_PAGES,
    MAX_MAP_BYTES,
    MAX_MAP_EXTENTS,
    PAGE_SIZE,
    ChunkRef,
    ImageMap,
    check_descriptor_sizes,
)
from forkd.pack.manifest import Descriptor, Manifest
from forkd.store.fetch import Want, fetch_chain
from forkd.store.store import Store

MIB = 1 << 20
SAFETY_NET = 120  # seconds; the bounded work takes well under one


def bytes_read() -> int:
    """Bytes this process has read through read(2) and friends so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "rchar":
            return int(value)
    raise AssertionError("/proc/self/io has no rchar")


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def put(store: Store, ref: str, *layers: Layer) -> None:
    for item in layers:
        for digest, data in item.blobs.items():
            store.blobs.put_bytes(data, digest)
        store.blobs.put_bytes(item.manifest, item.digest)
    store.tag(ref, layers[-1].digest)


@pytest.mark.timeout(SAFETY_NET)
def test_a_1_tib_pack_without_chunks_assembles_and_compacts_in_bounded_work(
    store: Store,
) -> None:
    put(store, "evil:v1", empty_tib("evil:v1"))
    before = bytes_read()

    asm = store.assemble("evil:v1")
    info = store.compact("evil:v1", "evil:flat")

    assert asm.memory.stat().st_size == TIB
    assert allocated(asm.memory) == 0  # holes, not zeros written
    assert bytes_read() - before < 4 * MIB  # manifests, configs, maps: not 1 TiB of holes
    assert info.depth == 0 and info.new_pages == 0
    flat = store.image_map(store.manifest(store.resolve("evil:flat")), "memory", "flat")
    assert flat is not None and flat.size == TIB and flat.chunks == ()
    assert allocated(store.assemble("evil:flat").memory) == 0


@pytest.mark.timeout(SAFETY_NET)
def test_a_sparse_1_tib_chain_compacts_reading_only_the_regions_chunks_write(
    store: Store,
) -> None:
    base, diff = sparse_tib_chain("evil:v1")
    put(store, "evil:v1", base, diff)
    before = bytes_read()

    store.compact("evil:v1", "evil:flat")

    # Three chunks survive (the diff zeroes none of them whole): their 515 pages are read
    # back once; the stored chunks and the small blobs are read once each too.
    assert bytes_read() - before < 4 * MIB
    flat_digest = store.resolve("evil:flat")
    flat = store.image_map(store.manifest(flat_digest), "memory", "flat")
    assert flat is not None and len(flat.chunks) == 3
    pages = TIB // PAGE_SIZE
    assert [c.extents for c in flat.chunks] == [
        ((0, 2),),  # pages 2, 3 were zeroed by the diff
        ((pages // 2, 1),),
        ((pages - 512, 512),),
    ]
    # The flat layer, assembled from its own chunks, has the chain's bytes.
    other = Store(store.home.parent / "other", blobs=store.blobs)
    other.tag("evil:flat", flat_digest)
    memory = other.assemble("evil:flat").memory
    assert allocated(memory) <= 3 * 2 * MIB
    with open(memory, "rb") as f:
        assert os.pread(f.fileno(), 4 * PAGE_SIZE, 0) == b"\1" * 2 * PAGE_SIZE + bytes(
            2 * PAGE_SIZE
        )
        assert os.pread(f.fileno(), PAGE_SIZE, pages // 2 * PAGE_SIZE) == b"\3" * PAGE_SIZE
        assert os.pread(f.fileno(), PAGE_SIZE, TIB - PAGE_SIZE) == b"\2" * PAGE_SIZE
        assert os.pread(f.fileno(), PAGE_SIZE, 5 * PAGE_SIZE) == bytes(PAGE_SIZE)


def test_flattening_follows_extents_not_the_declared_size() -> None:
    pages = TIB // PAGE_SIZE
    ref, _ = chunk([(7, 3), (pages - 1, 1)], 1)
    base = ImageMap("flat", TIB, (ref,))
    # Two diffs zeroing nearly everything: huge extents, a handful of them.
    top = ImageMap("diff", TIB, (), zero=((8, pages // 2),))
    mid = ImageMap("diff", TIB, (), zero=((0, 1), (pages // 2 + 100, pages // 4)))
    plan = flatten([top, mid, base], "test")
    assert [[(p.chunk_page, p.page, p.count) for p in pieces] for _, pieces in plan] == [
        [(0, 7, 1), (3, pages - 1, 1)]
    ]
    assert written_extents(plan) == [(7, 1), (pages - 1, 1)]
    # Pieces of different chunks that meet are one extent.
    a, _ = chunk([(CHUNK_PAGES - 1, 1)], 1)
    b, _ = chunk([(CHUNK_PAGES, 3)], 2)
    assert written_extents(flatten([ImageMap("flat", TIB, (b, a))], "t")) == [(CHUNK_PAGES - 1, 4)]


@pytest.mark.timeout(SAFETY_NET)
def test_a_chunk_scattered_over_many_regions_costs_its_pages_not_their_regions(
    store: Store,
) -> None:
    """512 pages in 512 different 2 MiB regions: one small chunk, 1 GiB of regions."""
    scattered, blob = chunk([(r * CHUNK_PAGES + r, 1) for r in range(CHUNK_PAGES)], 9)
    put(
        store,
        "evil:v1",
        layer("evil:v1", ImageMap("flat", TIB, (scattered,)), {scattered.digest: blob}),
    )
    before = bytes_read()

    store.compact("evil:v1", "evil:flat")

    assert bytes_read() - before < 16 * MIB
    flat = store.image_map(store.manifest(store.resolve("evil:flat")), "memory", "flat")
    assert flat is not None
    assert [c.extents for c in flat.chunks] == [((r * CHUNK_PAGES + r, 1),) for r in range(512)]


def test_reading_only_written_pages_gives_the_full_scans_chunks(
    store: Store, chain: list[str]
) -> None:
    """On a real chain (pages zeroed by diffs, whole regions, partial regions), chunking
    the written pages equals chunking the whole assembled image."""
    head = store.resolve("d3")
    links = store.chain(head)
    maps = [store.image_map(link.manifest, "memory", "t") for link in links]
    plan = flatten([m for m in maps if m is not None], "d3")
    memory = store.assemble("d3").memory
    with open(memory, "rb") as f:
        size = memory.stat().st_size
        full = [(c.data, c.extents) for c in flat_chunks(f, size)]
        written = [(c.data, c.extents) for c in flat_chunks(f, size, written=written_extents(plan))]
    assert written == full and len(full) > 1


def _padded(imap: ImageMap, size: int) -> bytes:
    data = imap.to_bytes()
    return data + b" " * (size - len(data))  # still valid JSON


def test_map_bounds_are_enforced_where_maps_are_parsed() -> None:
    small = ImageMap("flat", 1 << 30, ())
    assert ImageMap.from_bytes(_padded(small, MAX_MAP_BYTES)) == small  # at the bound
    with pytest.raises(IntegrityError, match=f"over the pack format's limit of {MAX_MAP_BYTES}"):
        ImageMap.from_bytes(_padded(small, MAX_MAP_BYTES + 1))

    pages = MAX_MAP_EXTENTS * 2
    at_bound = ImageMap("diff", pages * PAGE_SIZE, (), tuple((2 * i, 1) for i in range(pages // 2)))
    assert len(at_bound.to_bytes()) <= MAX_MAP_BYTES
    assert ImageMap.from_bytes(at_bound.to_bytes()).extent_count == MAX_MAP_EXTENTS
    over = ImageMap("diff", (pages + 2) * PAGE_SIZE, (), (*at_bound.zero, (pages, 1)))
    with pytest.raises(IntegrityError, match=f"{MAX_MAP_EXTENTS + 1} extents, over"):
        ImageMap.from_bytes(over.to_bytes())  # to_bytes does not validate; from_bytes must
    with pytest.raises(IntegrityError, match="extents, over"):
        over.validate()  # what a new layer's map goes through before it is written


def test_a_map_too_big_to_read_back_is_never_written() -> None:
    count = MAX_MAP_BYTES // 180 + 1  # a chunk entry encodes to ~190 bytes
    refs = tuple(
        ChunkRef(f"sha256:{i:064x}", f"{i:064x}", PAGE_SIZE, 99, ((i * CHUNK_PAGES, 1),))
        for i in range(count)
    )
    with pytest.raises(IntegrityError, match=r"image map is \d+ bytes, over"):
        ImageMap("flat", count * CHUNK_PAGES * PAGE_SIZE, refs).to_bytes()


def test_an_oversized_map_descriptor_is_refused_before_it_is_fetched(store: Store) -> None:
    """A registry's manifest may declare a 1 GiB map: pull refuses it from the descriptor."""
    ok = empty_tib("evil:v1")
    manifest = Manifest.from_bytes(ok.manifest)
    config = manifest.config
    huge = Descriptor(mt.MEMORY_MAP, dg.of_bytes(b"x"), 1 << 30)
    body = Manifest(config, {"memory": huge}, (), {}, None, {}).to_bytes()
    served = {dg.of_bytes(body): body, **ok.blobs}
    asked: list[Want] = []

    def fetch(wants: list[Want]) -> None:
        asked.extend(wants)
        for w in wants:
            store.blobs.put_bytes(served[w.digest], w.digest)

    with pytest.raises(IntegrityError, match="memory map is 1073741824 bytes, over"):
        fetch_chain(store, dg.of_bytes(body), "evil:v1", fetch)
    assert huge.digest not in {w.digest for w in asked}


def test_check_descriptor_sizes_reads_only_map_layers() -> None:
    layers = [
        {"mediaType": mt.MEMORY_CHUNK, "digest": "sha256:" + "0" * 64, "size": 1 << 40},
        {"mediaType": mt.DISK_MAP, "digest": "sha256:" + "1" * 64, "size": MAX_MAP_BYTES},
    ]
    check_descriptor_sizes({"layers": layers})  # big chunks are fine; a map at the bound too
    layers.append({"mediaType": mt.MEMORY_MAP, "digest": "sha256:" + "2" * 64, "size": 1 << 26})
    with pytest.raises(IntegrityError, match=r"layers\[2\] \(application/vnd.forkd.memory"):
        check_descriptor_sizes({"layers": layers})
    check_descriptor_sizes({"manifests": []})  # an index: no layers, nothing to check


def test_a_store_bounds_what_assembly_writes(store: Store, tmp_path: Path) -> None:
    """A chunk stores 2 MiB of a repeated byte in a few dozen bytes: a store given a bound
    (the hub's compaction) refuses from the plan, before writing anything."""
    ref, blob = chunk([(0, CHUNK_PAGES)], 7)
    assert len(blob) < 1024
    # Three regions given the same chunk: 6 MiB to write from one tiny blob.
    spread = tuple(
        ChunkRef(ref.digest, ref.blake3, ref.size, ref.stored, ((r * CHUNK_PAGES, CHUNK_PAGES),))
        for r in range(3)
    )
    put(store, "bomb:v1", layer("bomb:v1", ImageMap("flat", TIB, spread), {ref.digest: blob}))
    bounded = Store(tmp_path / "bounded", blobs=store.blobs, max_written=5 * MIB)
    bounded.tag("bomb:v1", store.resolve("bomb:v1"))
    with pytest.raises(InvalidInput, match="would get 6291456 bytes written, over the limit"):
        bounded.compact("bomb:v1", "bomb:flat")
    assert not list(bounded.cache_dir.rglob("*.img"))
    assert allocated(store.assemble("bomb:v1").memory) >= 6 * MIB  # no bound: written
