"""Pack size levers (issue 11 item 2): zstd levels per kind of layer, compaction reusing the
stored chunks of unchanged regions, bytes per component in `forkd inspect`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from image_support import REGIONS, text_image

from forkd.pack import mediatypes as mt
from forkd.pack.chunking import ZSTD_LEVEL, ZSTD_LEVEL_FLAT, compress, decompress
from forkd.pack.imagemap import CHUNK_SIZE, PAGE_SIZE, ImageMap
from forkd.store.store import Store


def _map(store: Store, tag: str, role: str = "memory") -> ImageMap:
    imap = store.image_map(store.manifest(store.resolve(tag)), role, tag)
    assert imap is not None
    return imap


def _raw_chunk(store: Store, chunk_digest: str, imap: ImageMap) -> bytes:
    ref = next(c for c in imap.chunks if c.digest == chunk_digest)
    return decompress(store.blobs.read(ref.digest, ref.stored), ref.size, "chunk")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


def test_flat_layers_use_the_strong_level_and_diffs_the_fast_one(store: Store, tmp_path: Path):
    base = tmp_path / "base.img"
    data = text_image(base, 1)
    store.import_layer("t:base", memory=base)
    flat = _map(store, "t:base")
    for c in flat.chunks:
        raw = _raw_chunk(store, c.digest, flat)
        assert store.blobs.read(c.digest, c.stored) == compress(raw, ZSTD_LEVEL_FLAT)
        assert compress(raw, ZSTD_LEVEL_FLAT) != compress(raw, ZSTD_LEVEL)  # levels differ
    changed = bytearray(data)
    changed[5 * PAGE_SIZE : 6 * PAGE_SIZE] = b"x" * PAGE_SIZE
    (tmp_path / "d1.img").write_bytes(bytes(changed))
    store.import_layer("t:d1", memory=tmp_path / "d1.img", parent="t:base")
    diff = _map(store, "t:d1")
    assert diff.kind == "diff" and len(diff.chunks) == 1
    c = diff.chunks[0]
    assert store.blobs.read(c.digest, c.stored) == compress(b"x" * PAGE_SIZE, ZSTD_LEVEL)


def test_compaction_reuses_the_base_chunks_of_unchanged_regions(store: Store, tmp_path: Path):
    base = tmp_path / "base.img"
    data = text_image(base, 2)
    store.import_layer("t:base", memory=base)
    changed = bytearray(data)
    changed[CHUNK_SIZE + 7 * PAGE_SIZE : CHUNK_SIZE + 8 * PAGE_SIZE] = b"y" * PAGE_SIZE
    (tmp_path / "d1.img").write_bytes(bytes(changed))
    store.import_layer("t:d1", memory=tmp_path / "d1.img", parent="t:base")
    store.compact("t:d1", "t:flat")
    base_chunks = {c.extents: c.digest for c in _map(store, "t:base").chunks}
    flat_chunks = {c.extents: c.digest for c in _map(store, "t:flat").chunks}
    assert set(flat_chunks) == set(base_chunks)
    same = [e for e in flat_chunks if flat_chunks[e] == base_chunks[e]]
    assert len(same) == REGIONS - 1  # every region but the changed one is the base's blob
    new = next(d for e, d in flat_chunks.items() if e not in same)
    raw = _raw_chunk(store, new, _map(store, "t:flat"))
    assert raw == bytes(changed[CHUNK_SIZE : 2 * CHUNK_SIZE])
    assert store.blobs.read(new, len(compress(raw, ZSTD_LEVEL))) == compress(raw, ZSTD_LEVEL)
    assert store.assemble("t:flat").memory.read_bytes() == bytes(changed)


def test_inspect_components_add_up_to_the_stored_size(store: Store, tmp_path: Path):
    mem, disk = tmp_path / "mem.img", tmp_path / "disk.img"
    text_image(mem, 3)
    text_image(disk, 4)
    state, kernel = tmp_path / "state", tmp_path / "vmlinux"
    state.write_bytes(b"state" * 100)
    kernel.write_bytes(b"kernel" * 1000)
    store.import_layer("t:base", memory=mem, disk=disk, vmstate=state, files={"kernel": kernel})
    changed = bytearray(mem.read_bytes())
    changed[:PAGE_SIZE] = bytes(PAGE_SIZE)
    (tmp_path / "m1.img").write_bytes(bytes(changed))
    store.import_layer("t:d1", memory=tmp_path / "m1.img", parent="t:base", vmstate=state)
    env = {**os.environ, "FORKD_HOME": str(store.home)}
    out = subprocess.run(["forkd", "inspect", "--json", "t:d1"], env=env, capture_output=True,
                         text=True, check=True, stdin=subprocess.DEVNULL, timeout=120).stdout
    info = json.loads(out)
    comps = info["components"]
    assert set(comps) == {"memory", "disk", "kernel", "initrd", "vmstate", "config"}
    assert sum(c["stored_bytes"] for c in comps.values()) == info["stored_bytes"]
    assert comps["kernel"] == {"stored_bytes": 6000, "logical_bytes": 6000, "data_bytes": 6000,
                               "blobs": 1}
    assert comps["initrd"]["blobs"] == 0 and comps["initrd"]["stored_bytes"] == 0
    assert comps["vmstate"]["stored_bytes"] == 500  # the same blob in both layers, once
    assert comps["config"]["blobs"] == 2
    assert comps["memory"]["logical_bytes"] == REGIONS * CHUNK_SIZE
    assert comps["disk"]["logical_bytes"] == REGIONS * CHUNK_SIZE
    head = store.manifest(store.resolve("t:d1"))
    base = store.manifest(store.resolve("t:base"))
    mem_chunks = {d.digest: d.size for m in (head, base) for d in m.chunks
                  if d.media_type == mt.MEMORY_CHUNK}
    mem_maps = {m.maps["memory"].digest: m.maps["memory"].size for m in (head, base)}
    assert comps["memory"]["stored_bytes"] == sum(mem_chunks.values()) + sum(mem_maps.values())
    # data: uncompressed bytes of the distinct chunks
    assert comps["memory"]["data_bytes"] == REGIONS * CHUNK_SIZE  # the diff only zeroes a page
    text = subprocess.run(["forkd", "inspect", "t:d1"], env=env, capture_output=True, text=True,
                          check=True, stdin=subprocess.DEVNULL, timeout=120).stdout
    assert "initrd   not in this pack" in text
    assert "kernel   stored" in text
