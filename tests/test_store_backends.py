"""A Store over any BlobStore (issue 11 item 7): the filesystem and S3 (a real moto_server).

The store's jobs read and write blobs through the protocol only, so a store whose blobs
are in a bucket imports layers (with their whole-file blobs: vmstate, kernel), assembles
chains, compacts them, verifies and collects garbage like a local one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_support import MotoServer, s3_leftovers

from forkd.errors import NotFound
from forkd.store.blobs import BlobStore, FsBlobStore
from forkd.store.s3 import MIN_PART_SIZE, S3BlobStore
from forkd.store.store import Store


@pytest.fixture(params=["fs", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "fs":
        yield FsBlobStore(tmp_path / "blobs")
        return
    server: MotoServer = request.getfixturevalue("moto_server")
    client, bucket = server.client(), server.new_bucket()
    store = S3BlobStore(client, bucket, "store/", part_size=MIN_PART_SIZE)
    yield store
    assert s3_leftovers(client, bucket, store.prefix) == [], "temporary keys or uploads left"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {"vmstate": tmp_path / "vmstate", "kernel": tmp_path / "vmlinux"}
    out["vmstate"].write_bytes(b"device state " * 1000)
    out["kernel"].write_bytes(b"\x7fELF kernel " * 5000)
    return out


def _import_chain(store: Store, images: list[Path], files: dict[str, Path]) -> None:
    store.import_layer(
        "app:base",
        memory=images[0],
        vmstate=files["vmstate"],
        files={"kernel": files["kernel"]},
    )
    for i, image in enumerate(images[1:], 1):
        parent = "app:base" if i == 1 else f"app:d{i - 1}"
        store.import_layer(f"app:d{i}", memory=image, parent=parent, vmstate=files["vmstate"])


def test_a_store_imports_assembles_and_compacts_on_any_backend(
    blobs: BlobStore, tmp_path: Path, images: list[Path], files: dict[str, Path]
) -> None:
    store = Store(tmp_path / "home", blobs=blobs)
    _import_chain(store, images, files)
    asm = store.assemble("app:d3")
    assert asm.memory.read_bytes() == images[3].read_bytes()
    assert asm.vmstate is not None and asm.vmstate.read_bytes() == files["vmstate"].read_bytes()
    assert asm.files["kernel"].read_bytes() == files["kernel"].read_bytes()

    flat = store.compact("app:d3", "app:flat")
    assert flat.depth == 0 and flat.compacted
    again = Store(tmp_path / "other-home", blobs=blobs)  # a fresh cache over the same blobs
    again.tag("app:flat", flat.digest)
    got = again.assemble("app:flat")
    assert got.memory.read_bytes() == images[3].read_bytes()
    assert got.files["kernel"].read_bytes() == files["kernel"].read_bytes()
    assert store.verify() == []


def test_gc_on_any_backend_keeps_what_tags_reach(
    blobs: BlobStore, tmp_path: Path, images: list[Path], files: dict[str, Path]
) -> None:
    store = Store(tmp_path / "home", blobs=blobs)
    _import_chain(store, images, files)
    flat = store.compact("app:d3", "app:flat")
    store.remove("app:base", cascade=True)
    removed, freed = store.gc()
    assert removed > 0 and freed > 0
    assert store.verify() == []
    fresh = Store(tmp_path / "fresh", blobs=blobs)
    fresh.tag("app:flat", flat.digest)
    assert fresh.assemble("app:flat").memory.read_bytes() == images[3].read_bytes()


def test_a_missing_file_blob_is_named_on_any_backend(
    blobs: BlobStore, tmp_path: Path, images: list[Path], files: dict[str, Path]
) -> None:
    store = Store(tmp_path / "home", blobs=blobs)
    _import_chain(store, images, files)
    kernel = store.manifest(store.resolve("app:base")).files["kernel"].digest
    blobs.delete(kernel)
    fresh = Store(tmp_path / "fresh", blobs=blobs)
    fresh.tag("app:d3", store.resolve("app:d3"))
    with pytest.raises(NotFound, match=f"the kernel blob {kernel} is missing"):
        fresh.assemble("app:d3")
    with pytest.raises(NotFound, match=f"the kernel blob {kernel} is missing"):
        fresh.compact("app:d3", "app:flat")
