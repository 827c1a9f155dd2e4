"""Chunks compressed ahead of an import (chunking.Precompressed, what `forkd build` makes of
the root disk while its template boots): the import stores those frames instead of
compressing again, only for equal bytes at the same place and level; the layer reads back
byte for byte; the holder is bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
from image_support import REGIONS, text_image

from forkd.pack.chunking import ZSTD_LEVEL_FLAT, Precompressed, compress, unpack_chunk
from forkd.pack.imagemap import CHUNK_SIZE
from forkd.store.store import Store


def _frames_at_level_1(path: Path) -> Precompressed:
    """Frames made at level 1 but labelled as the flat level: which frame a stored chunk
    came from is then visible in its bytes (zstd frames are deterministic per level)."""
    ready = Precompressed(1)
    ready.add_image(str(path), lambda: False)
    ready.level = ZSTD_LEVEL_FLAT
    return ready


def test_import_stores_the_ready_frames_of_unwritten_regions(tmp_path: Path) -> None:
    root = tmp_path / "root.raw"
    data = text_image(root, 1)
    ready = _frames_at_level_1(root)
    written = bytearray(data)
    written[CHUNK_SIZE + 100 : CHUNK_SIZE + 200] = b"x" * 100  # the guest wrote region 1
    disk = tmp_path / "disk.raw"
    disk.write_bytes(bytes(written))
    mem = tmp_path / "mem.img"
    mem.write_bytes(data[:CHUNK_SIZE])
    store = Store(tmp_path / "home")
    store.import_layer("t:built", memory=mem, disk=disk, disk_ready=ready)
    m = store.manifest(store.resolve("t:built"))
    imap = store.image_map(m, "disk", "t:built")
    assert imap is not None and len(imap.chunks) == REGIONS
    for i, c in enumerate(imap.chunks):
        raw = bytes(written[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE])
        blob = store.blobs.read(c.digest, c.stored)
        assert unpack_chunk(blob, c, "chunk") == raw  # reads back byte for byte
        expected_level = ZSTD_LEVEL_FLAT if i == 1 else 1  # only the written one anew
        assert blob == compress(raw, expected_level)
    store.verify()


def test_frames_at_another_level_are_not_used(tmp_path: Path) -> None:
    root = tmp_path / "root.raw"
    data = text_image(root, 2)
    ready = Precompressed(1)
    ready.add_image(str(root), lambda: False)
    store = Store(tmp_path / "home")
    mem = tmp_path / "mem.img"
    mem.write_bytes(data[:CHUNK_SIZE])
    store.import_layer("t:built", memory=mem, disk=root, disk_ready=ready)
    imap = store.image_map(store.manifest(store.resolve("t:built")), "disk", "t:built")
    assert imap is not None
    for i, c in enumerate(imap.chunks):
        raw = data[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]
        assert store.blobs.read(c.digest, c.stored) == compress(raw, ZSTD_LEVEL_FLAT)


@pytest.mark.parametrize("bound", ["stop", "max_bytes"])
def test_precompressed_is_bounded(tmp_path: Path, bound: str) -> None:
    root = tmp_path / "root.raw"
    text_image(root, 3)
    if bound == "stop":
        ready = Precompressed(1)
        calls = iter(range(100))
        ready.add_image(str(root), lambda: next(calls) >= 2)  # stop after two chunks
        assert len(ready._frames) == 2
    else:
        ready = Precompressed(1, max_bytes=1)
        ready.add_image(str(root), lambda: False)
        assert len(ready._frames) == 1  # full after its first frame
    assert ready.held == sum(len(f) for f in ready._frames.values())
