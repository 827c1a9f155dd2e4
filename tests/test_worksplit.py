"""A layer's memory chunks split by a working set (forkd.store.worksplit): the same image
page for page, every chunk wholly inside or wholly outside the working set, the chunks that
were already one-sided kept as they were, and nothing else of the layer changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forkd.errors import NotFound
from forkd.pack.imagemap import CHUNK_PAGES, ImageMap
from forkd.store.store import Store
from forkd.store.worksplit import pages_of, split_memory


def _memory_map(store: Store, digest: str) -> ImageMap:
    imap = store.image_map(store.manifest(digest), "memory", digest)
    assert imap is not None
    return imap


def _uncached(store: Store) -> None:
    """Drop every cached image, so an assembly reads the layer's own chunks."""
    for entry in store.cache_dir.iterdir():
        for f in entry.iterdir():
            f.unlink()
        entry.rmdir()


def _touched(imap: ImageMap) -> set[int]:
    """A working set that cuts the first chunk in two, takes the second whole and leaves
    the others out: every case of a chunk against a working set."""
    first, second = pages_of(imap.chunks[0]), pages_of(imap.chunks[1])
    return set(first[::3]) | set(second)


def test_split_keeps_the_image_and_cuts_only_the_chunks_that_straddle(
        store: Store, images: list[Path], chain: list[str]) -> None:
    old = store.resolve("base")
    before = _memory_map(store, old)
    assert len(before.chunks) >= 3
    touched = _touched(before)
    new = split_memory(store, "base", touched | {10 ** 9})  # past the image: ignored
    assert new != old and store.resolve("base") == new
    after = _memory_map(store, new)
    for chunk in after.chunks:  # each chunk wholly on one side
        inside = {p in touched for p in pages_of(chunk)}
        assert len(inside) == 1, chunk
    assert len(after.chunks) == len(before.chunks) + 1  # only the first was cut
    kept = {c.digest for c in before.chunks[1:]}
    assert kept <= {c.digest for c in after.chunks}  # one-sided chunks keep their blobs
    assert sum(len(pages_of(c)) for c in after.chunks) == sum(
        len(pages_of(c)) for c in before.chunks)
    # nothing else of the layer changed
    m_old, m_new = store.manifest(old), store.manifest(new)
    assert m_new.config == m_old.config and m_new.files == m_old.files
    assert m_new.maps.get("disk") == m_old.maps.get("disk")
    assert m_new.subject == m_old.subject and m_new.annotations == m_old.annotations
    # the same image, read from the new chunks alone (the old tag's blobs are gone)
    store.gc()
    _uncached(store)
    assert store.assemble("base").memory.read_bytes() == images[0].read_bytes()
    assert store.assemble("d3").memory.read_bytes() == images[3].read_bytes()  # on old base


def test_split_of_a_diff_keeps_its_parent_edge(store: Store, images: list[Path],
                                               chain: list[str]) -> None:
    old = store.resolve("d2")
    before = _memory_map(store, old)
    touched = set(pages_of(before.chunks[0])[: len(pages_of(before.chunks[0])) // 2])
    new = split_memory(store, "d2", touched)
    after = _memory_map(store, new)
    assert after.kind == "diff" and after.zero == before.zero
    assert store.manifest(new).subject == store.manifest(old).subject
    assert store.manifest(new).parent_tag == "d1:latest"
    assert len(after.chunks) == len(before.chunks) + 1
    _uncached(store)
    assert store.assemble("d2").memory.read_bytes() == images[2].read_bytes()


def test_nothing_to_split_leaves_the_layer_as_it_is(store: Store, chain: list[str]) -> None:
    old = store.resolve("base")
    whole = {p for c in _memory_map(store, old).chunks[:2] for p in pages_of(c)}
    assert split_memory(store, "base", whole) == old
    assert split_memory(store, "base", set()) == old
    assert store.resolve("base") == old


def test_a_chunk_cut_to_single_pages_keeps_every_byte(store: Store, tmp_path: Path) -> None:
    """Every other page touched: the two chunks of each region interleave page by page."""
    image = tmp_path / "dense.mem"
    image.write_bytes(b"".join(bytes([i % 251 + 1]) * 4096 for i in range(2 * CHUNK_PAGES)))
    store.import_layer("dense", memory=image)
    new = split_memory(store, "dense", set(range(0, 2 * CHUNK_PAGES, 2)))
    assert len(_memory_map(store, new).chunks) == 4
    _uncached(store)
    assert store.assemble("dense").memory.read_bytes() == image.read_bytes()


def test_an_unknown_tag_is_refused(store: Store) -> None:
    with pytest.raises(NotFound):
        split_memory(store, "nothing-here", {1})


def test_a_split_moves_this_stores_build_records_only(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's own record and a shared record naming the layer as built both lead
    this store to the split layer; the shared record still names the layer as built, so
    another store holding only that finds it, and a record of another snapshot stays."""
    from forkd.engine import build

    monkeypatch.setenv("FORKD_CACHE", str(tmp_path / "cache"))
    old, new, other = ("sha256:" + c * 64 for c in "abc")
    build._record_build(store, "sha256:" + "1" * 64, "r:one", old)  # own and shared
    shared_only = build._cache_files(store, "sha256:" + "2" * 64)
    shared_only[1].write_text(json.dumps({"ref": "r:two", "digest": old}))
    build._record_build(store, "sha256:" + "3" * 64, "r:three", other)
    build.rerecord(store, old, new)

    def said(f: Path) -> str:
        return str(json.loads(f.read_text())["digest"])

    own1, shared1 = build._cache_files(store, "sha256:" + "1" * 64)
    own2, shared2 = shared_only
    own3, shared3 = build._cache_files(store, "sha256:" + "3" * 64)
    assert (said(own1), said(own2)) == (new, new)  # this store: the split layer
    assert (said(shared1), said(shared2)) == (old, old)  # another store: as built
    assert (said(own3), said(shared3)) == (other, other)


def test_a_guest_touching_every_other_page_cannot_fragment_the_map_past_its_budget(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The touched pages are the guest's choice: every other page would cut each chunk
    into one-page extents. Chunks are split only while the map stays within
    MAX_SPLIT_EXTENTS; the others stay whole, and the image is the same."""
    from forkd.store import worksplit

    image = tmp_path / "dense.mem"
    image.write_bytes(b"".join(bytes([i % 251 + 1]) * 4096 for i in range(4 * CHUNK_PAGES)))
    store.import_layer("dense", memory=image)
    before = _memory_map(store, store.resolve("dense"))
    per_split = CHUNK_PAGES - 1  # one extent becomes 512 one-page extents
    budget = before.extent_count + 2 * per_split  # room for two chunks' splits
    monkeypatch.setattr(worksplit, "MAX_SPLIT_EXTENTS", budget)
    new = split_memory(store, "dense", set(range(0, 4 * CHUNK_PAGES, 2)))
    after = _memory_map(store, new)
    assert after.extent_count <= budget
    assert len(after.chunks) == len(before.chunks) + 2  # two split, two left whole
    _uncached(store)
    assert store.assemble("dense").memory.read_bytes() == image.read_bytes()
