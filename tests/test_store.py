from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from forkd import digest as dg
from forkd.errors import ChainError, Conflict, ForkdError, IntegrityError, InvalidInput, NotFound
from forkd.pack import mediatypes as mt
from forkd.pack.chain import walk
from forkd.pack.imagemap import CHUNK_SIZE, PAGE_SIZE
from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff


def _chunk_files(store: Store, tag: str) -> list[Path]:
    m = store.manifest(store.resolve(tag))
    return [store.blobs.path(d.digest) for d in m.chunks]


def _no_temp_files(store: Store) -> bool:
    leftovers = list(store.blobs.tmp.iterdir())
    leftovers += [p for p in store.cache_dir.rglob("*") if p.name.startswith(".")]
    return not leftovers


def test_assembled_chain_is_byte_identical(store: Store, images: list[Path], chain: list[str]):
    for tag, image in zip(chain, images, strict=True):
        asm = store.assemble(tag)
        assert asm.memory.read_bytes() == image.read_bytes(), tag
    assert store.config(store.resolve("d3")).depth == 3


def test_diff_stores_only_changed_pages(store: Store, images: list[Path], chain: list[str]):
    pages = images[0].stat().st_size // PAGE_SIZE
    for tag in chain[1:]:
        info = next(i for i in store.images() if i.ref == f"{tag}:latest")
        changed = int(pages * 0.05)
        # The zeroed share of changed pages is listed, not stored.
        assert changed * 0.8 <= info.new_pages <= changed
        raw = info.new_pages * PAGE_SIZE
        assert info.stored_bytes < raw * 1.1 + 64 * 1024, "diff layer must not store the full image"
        assert info.stored_bytes < images[0].stat().st_size / 5


def test_zero_regions_are_not_stored(store: Store, tmp_path: Path):
    image = tmp_path / "zero.mem"
    with open(image, "wb") as f:
        f.truncate(16 * CHUNK_SIZE)
        f.seek(5 * CHUNK_SIZE + 3 * PAGE_SIZE)
        f.write(b"x" * PAGE_SIZE)
    info = store.import_layer("sparse", memory=image)
    assert info.new_pages == 1
    assert len(_chunk_files(store, "sparse")) == 1
    assert store.assemble("sparse").memory.read_bytes() == image.read_bytes()


def test_page_diff_and_zeroed_pages(store: Store, tmp_path: Path):
    base = tmp_path / "b.mem"
    write_base(base, 4 * CHUNK_SIZE, seed=3, random_share=1.0)
    store.import_layer("b", memory=base)
    data = bytearray(base.read_bytes())
    data[0:PAGE_SIZE] = bytes(PAGE_SIZE)
    pages = [(0, bytes(PAGE_SIZE)), (10, b"a" * PAGE_SIZE), (900, b"b" * PAGE_SIZE)]
    for index, page in pages:
        data[index * PAGE_SIZE : (index + 1) * PAGE_SIZE] = page
    info = store.import_pages("b2", parent="b", pages=pages)
    assert info.depth == 1 and info.new_pages == 2
    assert store.assemble("b2").memory.read_bytes() == bytes(data)
    with pytest.raises(InvalidInput):
        store.import_pages("b3", parent="b", pages=[(5, b"x" * PAGE_SIZE), (4, b"y" * PAGE_SIZE)])


def test_assembly_cache_is_reused(store: Store, chain: list[str]):
    first = store.assemble("d3")
    stat = first.memory.stat()
    second = store.assemble("d3")
    assert second.memory == first.memory
    assert second.memory.stat().st_ino == stat.st_ino
    assert second.memory.stat().st_mtime_ns == stat.st_mtime_ns


def test_vmstate_disk_and_files_round_trip(store: Store, images: list[Path], tmp_path: Path):
    state, kernel = tmp_path / "state", tmp_path / "vmlinux"
    state.write_bytes(b"device state")
    kernel.write_bytes(b"kernel" * 1000)
    disk = tmp_path / "root.img"
    write_base(disk, 2 * CHUNK_SIZE, seed=9)
    store.import_layer("full", memory=images[0], vmstate=state, disk=disk, files={"kernel": kernel})
    disk2 = tmp_path / "root2.img"
    write_diff(disk, disk2, share=0.05, seed=1)
    state2 = tmp_path / "state2"
    state2.write_bytes(b"later state")
    store.import_layer("child", memory=images[1], vmstate=state2, disk=disk2, parent="full")
    asm = store.assemble("child")
    assert asm.vmstate is not None and asm.vmstate.read_bytes() == b"later state"
    assert asm.disk is not None and asm.disk.read_bytes() == disk2.read_bytes()
    assert asm.files["kernel"].read_bytes() == kernel.read_bytes()  # inherited from the base
    flat = store.compact("child", "child-flat")
    asm2 = store.assemble("child-flat")
    assert flat.depth == 0
    assert asm2.disk is not None and asm2.disk.read_bytes() == disk2.read_bytes()
    assert asm2.files["kernel"].read_bytes() == kernel.read_bytes()
    assert asm2.vmstate is not None and asm2.vmstate.read_bytes() == b"later state"


def test_compact_same_bytes_with_provenance_and_dedup(store: Store, images, chain):
    before = {p.name for p in store.blobs.root.rglob("*") if p.is_file()}
    info = store.compact("d3", "flat")
    assert info.depth == 0 and info.compacted
    digest = store.resolve("flat")
    cfg = store.config(digest)
    assert cfg.compacted_from is not None
    assert cfg.compacted_from.from_digest == store.resolve("d3")
    assert cfg.compacted_from.reason == "manual"
    m = store.manifest(digest)
    assert m.subject is None
    assert m.annotations[mt.ANNOTATION_COMPACTED_FROM].startswith("d3:latest@sha256:")
    store.gc()  # drop the cache so the flat tag is assembled from its own chunks
    for entry in store.cache_dir.iterdir():
        for f in entry.iterdir():
            f.unlink()
        entry.rmdir()
    assert store.assemble("flat").memory.read_bytes() == images[3].read_bytes()
    # Unchanged 2 MiB regions give the same chunk as the base: not stored twice.
    base_chunks = set(_chunk_files(store, "base"))
    flat_chunks = set(_chunk_files(store, "flat"))
    new = {p.name for p in store.blobs.root.rglob("*") if p.is_file()} - before
    assert len(new) < len(flat_chunks) + 4 or base_chunks & flat_chunks


def test_auto_compaction_keeps_bytes(home: Path, images: list[Path]):
    store = Store(home, auto_compact_depth=2)
    parent = None
    for i, image in enumerate(images):
        info = store.import_layer(f"l{i}", memory=image, parent=parent)
        parent = f"l{i}"
    assert info.compacted and info.depth == 0
    cfg = store.config(store.resolve("l3"))
    assert cfg.compacted_from is not None and cfg.compacted_from.reason == "auto-depth"
    assert cfg.compacted_from.from_digest == store.resolve("l2")
    assert store.assemble("l3").memory.read_bytes() == images[3].read_bytes()
    # The next layer stacks on the compacted one again.
    nxt = images[0].parent / "next.mem"
    write_diff(images[3], nxt, share=0.05, seed=55)
    assert store.import_layer("l4", memory=nxt, parent="l3").depth == 1
    assert store.assemble("l4").memory.read_bytes() == nxt.read_bytes()


def test_auto_compaction_depth_from_env(home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FORKD_AUTO_COMPACT_DEPTH", "3")
    assert Store(home).auto_compact_depth == 3
    monkeypatch.setenv("FORKD_AUTO_COMPACT_DEPTH", "zero")
    with pytest.raises(InvalidInput):
        Store(home)


def test_rmi_refuses_parent_unless_cascade(store: Store, chain: list[str]):
    with pytest.raises(Conflict, match="d1:latest, d2:latest, d3:latest"):
        store.remove("base")
    assert store.remove("d3") == ["d3:latest"]
    assert store.remove("d1", cascade=True) == ["d1:latest", "d2:latest"]
    assert [i.ref for i in store.images()] == ["base:latest"]


def test_gc_removes_only_unreachable(store: Store, chain: list[str], images):
    store.assemble("d3")
    store.remove("d2", cascade=True)
    count, freed = store.gc()
    assert count > 0 and freed > 0
    assert store.assemble("d1").memory.read_bytes() == images[1].read_bytes()
    assert not (store.cache_dir / dg.hex_part(dg.of_bytes(b"x"))).exists()
    assert store.gc() == (0, 0)
    store.remove("d1", cascade=True)
    store.remove("base")
    store.gc()
    assert list(store.blobs.digests()) == []


def _import_same(home: str, image: str, tag: str) -> None:
    Store(Path(home)).import_layer(tag, memory=Path(image))


def test_concurrent_writers_store_one_copy(home: Path, images: list[Path]):
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_import_same, args=(str(home), str(images[0]), f"t{i}"))
        for i in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    store = Store(home)
    assert len(store.images()) == 3
    # Same content, one copy: the chunks and the memory map are shared by the three layers.
    manifests = [store.manifest(i.digest) for i in store.images()]
    assert len({m.maps["memory"].digest for m in manifests}) == 1
    chunks = {d.digest for d in manifests[0].chunks}
    blob_files = {f"sha256:{p.name}" for p in (home / "blobs" / "sha256").rglob("*") if p.is_file()}
    assert len(blob_files) == len(chunks) + 1 + 3 * 2  # chunks, map, 3x (config, manifest)
    for digest in blob_files:
        assert dg.of_bytes(store.blobs.path(digest).read_bytes()) == digest
    assert not list(store.blobs.tmp.iterdir())


@pytest.mark.parametrize("damage", ["tamper", "truncate", "delete"])
def test_damaged_chunk_fails_naming_tag_and_layer(store: Store, chain, damage: str, tmp_path: Path):
    victim = _chunk_files(store, "d2")[0]
    os.chmod(victim, 0o644)
    if damage == "tamper":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(data)
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-10])
    else:
        victim.unlink()
    with pytest.raises(ForkdError) as info:
        store.assemble("d3")
    message = str(info.value)
    assert "d3:latest" in message and "layer 1" in message
    assert not (store.cache_dir / dg.hex_part(store.resolve("d3")) / "memory.img").exists()
    assert _no_temp_files(store)


def test_missing_parent_and_self_parent(store: Store, images: list[Path]):
    with pytest.raises(NotFound, match="no tag ghost:latest"):
        store.import_layer("x", memory=images[0], parent="ghost")
    store.import_layer("x", memory=images[0])
    with pytest.raises(ChainError, match="own parent"):
        store.import_layer("x", memory=images[1], parent="x", force=True)
    assert [i.ref for i in store.images()] == ["x:latest"]


def test_existing_tag_needs_force(store: Store, images: list[Path]):
    store.import_layer("x", memory=images[0])
    with pytest.raises(Conflict):
        store.import_layer("x", memory=images[1])
    store.import_layer("x", memory=images[1], force=True)
    assert store.assemble("x").memory.read_bytes() == images[1].read_bytes()


def test_memory_size_must_match_parent(store: Store, images: list[Path], tmp_path: Path):
    store.import_layer("base", memory=images[0])
    other = tmp_path / "other.mem"
    write_base(other, 2 * CHUNK_SIZE, seed=1)
    with pytest.raises(InvalidInput, match="keeps the parent's memory size"):
        store.import_layer("bad", memory=other, parent="base")


def test_bad_image_files_refused(store: Store, tmp_path: Path):
    odd = tmp_path / "odd.mem"
    odd.write_bytes(b"x" * 1000)
    with pytest.raises(InvalidInput, match="multiple of 4096"):
        store.import_layer("odd", memory=odd)
    with pytest.raises(InvalidInput, match="cannot read"):
        store.import_layer("none", memory=tmp_path / "missing.mem")
    assert store.images() == []


def test_walk_refuses_cycles_and_deep_chains(store: Store, chain: list[str]):
    real = {d: store.manifest(d) for d in (store.resolve(t) for t in chain)}
    head, base = store.resolve("d3"), store.resolve("base")
    from dataclasses import replace

    looped = dict(real)
    looped[base] = replace(
        real[base], subject=real[store.resolve("d1")].subject.__class__(mt.OCI_MANIFEST, head, 10)
    )
    with pytest.raises(ChainError, match="cycle"):
        walk(head, looped.__getitem__, name="d3")
    with pytest.raises(ChainError, match="deeper than the cap of 2"):
        walk(head, real.__getitem__, max_depth=2, name="d3")
    assert len(walk(head, real.__getitem__, name="d3")) == 4


def test_corrupt_tags_file_is_reported(store: Store, chain: list[str]):
    store.tags.path.write_text(json.dumps({"../evil": "sha256:" + "0" * 64}))
    with pytest.raises((IntegrityError, InvalidInput)):
        store.images()


def test_tag_existing_snapshot(store: Store, chain: list[str]):
    digest = store.tag("again", "d2")
    assert digest == store.resolve("d2") == store.resolve("again")
    assert store.tag("by-digest", digest) == digest
    with pytest.raises(Conflict):
        store.tag("again", "d3")
    assert store.tag("again", "d3", force=True) == store.resolve("d3")
    with pytest.raises(NotFound):
        store.tag("x", "sha256:" + "0" * 64)
    with pytest.raises(InvalidInput):
        store.tag("x", "sha256:nothex")


def test_gc_keeps_cached_images_a_process_maps(store: Store, chain: list[str]):
    import mmap

    asm = store.assemble("d3")
    with open(asm.memory, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        store.remove("d1", cascade=True)
        store.gc()
        assert asm.memory.exists()  # a running VM's image survives its tag
    store.gc()
    assert not asm.memory.exists()


def test_a_description_that_is_not_one_line_is_refused_before_any_write(
        store: Store, tmp_path: Path) -> None:
    """The layer's config holds its description as one line (SnapshotConfig.validate):
    ``forkd import --description`` with a line break or an escape wrote every chunk, then
    failed at the config (IntegrityError); now it is InvalidInput before anything is
    written."""
    image = tmp_path / "m.mem"
    image.write_bytes(b"m" * PAGE_SIZE)
    for bad in ("two\nlines", "\x1b]52;c;eA==\x07"):
        with pytest.raises(InvalidInput, match="description may not contain"):
            store.import_layer("bad", memory=image, description=bad)
    assert "bad:latest" not in store.tags.read()
