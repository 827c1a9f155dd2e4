"""What a hostile pack's maps claim about a chunk (tests/hostile_packs.py): a stored size no
zstd frame of the chunk can have (a reader would fetch, store and read into memory that
much for one chunk) is refused with the map; one digest named with two different sizes or
content hashes in a chain (a lazy reader serves a chunk by its digest: one of the two
would be served short or shifted) is refused before anything is served."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from hostile_packs import chunk, layer

from forkd.engine.lazy.chunks import ChunkSource
from forkd.errors import IntegrityError
from forkd.pack.chunking import compress
from forkd.pack.imagemap import CHUNK_SIZE, PAGE_SIZE, ImageMap, max_stored
from forkd.store.store import Store

PAGES = 16


def test_the_stored_bound_admits_every_zstd_frame() -> None:
    for size in (PAGE_SIZE, 2 * PAGE_SIZE, 64 << 10, 256 << 10, CHUNK_SIZE):
        assert len(compress(os.urandom(size))) <= max_stored(size)


def test_a_chunk_claiming_more_stored_bytes_than_a_frame_is_refused() -> None:
    ref, _ = chunk([(0, 4)], 1)
    for stored in (max_stored(ref.size) + 1, 1 << 40):
        hostile = ImageMap("flat", PAGES * PAGE_SIZE, (replace(ref, stored=stored),))
        with pytest.raises(IntegrityError, match="stored bytes"):
            ImageMap.from_bytes(hostile.to_bytes())


def test_one_digest_with_two_contents_in_a_chain_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    real, blob = chunk([(0, 1)], 1)
    other, _ = chunk([(1, 2)], 2)
    base = layer("app:v1", ImageMap("flat", PAGES * PAGE_SIZE, (real,)), {real.digest: blob})
    # the diff names the base's chunk for two pages, with another chunk's size and blake3
    lie = replace(other, digest=real.digest, stored=real.stored)
    diff = layer("app:v2", ImageMap("diff", PAGES * PAGE_SIZE, (lie,)), parent=base)
    for part in (base, diff):
        for digest, data in part.blobs.items():
            store.blobs.put_bytes(data, digest)
        store.blobs.put_bytes(part.manifest, part.digest)
    chain = store.chain(diff.digest, "app:v2")
    with pytest.raises(IntegrityError, match=f"{real.digest} twice"):
        ChunkSource(store, chain, "app:v2")
    # the honest chain (the same digest once) opens
    assert real.digest in ChunkSource(store, store.chain(base.digest, "app:v1"), "app:v1").refs


def test_a_config_declared_past_its_bound_is_refused_with_the_manifest() -> None:
    """A config is at most MAX_CONFIG_BYTES when read: a manifest declaring a larger one
    (1 TiB: a pull or a lazy fork would stream it to disk first) is refused as parsed."""
    import json

    from forkd.pack.config import MAX_CONFIG_BYTES
    from forkd.pack.manifest import Manifest

    ref, blob = chunk([(0, 1)], 1)
    doc = json.loads(layer("app:v1", ImageMap("flat", PAGES * PAGE_SIZE, (ref,)),
                           {ref.digest: blob}).manifest)
    for size in (MAX_CONFIG_BYTES + 1, 1 << 40):
        doc["config"]["size"] = size
        with pytest.raises(IntegrityError, match="config is"):
            Manifest.from_bytes(json.dumps(doc).encode())
