from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import zstandard

from forkd import digest as dg
from forkd.errors import ForkdError, IntegrityError, InvalidInput
from forkd.pack import mediatypes as mt
from forkd.pack.chunking import decompress
from forkd.pack.imagemap import CHUNK_SIZE, ImageMap
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Manifest
from forkd.store.packfile import export_pack, import_pack
from forkd.store.store import Store


def _fresh(tmp_path: Path, name: str) -> Store:
    return Store(tmp_path / name)


def _rewrite(pack: Path, out: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Copy a pack tar, letting ``change(name, data)`` return new bytes (or None to drop)."""
    with tarfile.open(pack) as src, tarfile.open(out, "w") as dst:
        for info in src.getmembers():
            f = src.extractfile(info)
            data = f.read() if f else b""
            new = change(info.name, data)
            if new is None:
                continue
            info.size = len(new)
            dst.addfile(info, io.BytesIO(new))


def test_export_import_round_trip(
    store: Store, chain: list[str], images: list[Path], tmp_path: Path
):
    pack = tmp_path / "d3.pack"
    export_pack(store, "d3", pack)
    other = _fresh(tmp_path, "other")
    result = import_pack(other, pack)
    assert result.head == "d3:latest"
    assert sorted(result.tags) == ["base:latest", "d1:latest", "d2:latest", "d3:latest"]
    assert other.resolve("d3") == store.resolve("d3")
    assert other.assemble("d3").memory.read_bytes() == images[3].read_bytes()
    with tarfile.open(pack) as tar:
        names = tar.getnames()
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
    assert "oci-layout" in names
    assert index["manifests"][0]["annotations"][mt.ANNOTATION_REF_NAME] == "d3:latest"
    # Importing again is idempotent.
    assert import_pack(other, pack).head == "d3:latest"


def test_tampered_pack_leaves_no_tag(store: Store, chain: list[str], tmp_path: Path):
    pack = tmp_path / "d3.pack"
    export_pack(store, "d3", pack)
    victim = store.manifest(store.resolve("d2")).chunks[0].digest

    def flip(name: str, data: bytes) -> bytes:
        if name.endswith(dg.hex_part(victim)):
            return data[:-1] + bytes([data[-1] ^ 1])
        return data

    bad = tmp_path / "bad.pack"
    _rewrite(pack, bad, flip)
    other = _fresh(tmp_path, "other")
    with pytest.raises(IntegrityError) as info:
        import_pack(other, bad)
    assert "d3:latest layer 1" in str(info.value)
    assert other.tags.read() == {}
    assert not list(other.blobs.tmp.iterdir())


def test_pack_missing_blob_refused(store: Store, chain: list[str], tmp_path: Path):
    pack = tmp_path / "d3.pack"
    export_pack(store, "d3", pack)
    victim = dg.hex_part(store.manifest(store.resolve("base")).maps["memory"].digest)
    bad = tmp_path / "bad.pack"
    _rewrite(pack, bad, lambda name, data: None if name.endswith(victim) else data)
    other = _fresh(tmp_path, "other")
    with pytest.raises(IntegrityError, match="missing from the pack"):
        import_pack(other, bad)
    assert other.tags.read() == {}


@pytest.mark.parametrize("member", ["../evil", "/etc/passwd", "blobs/sha256/../../x", "link"])
def test_hostile_tar_members_refused(tmp_path: Path, member: str):
    pack = tmp_path / "hostile.pack"
    with tarfile.open(pack, "w") as tar:
        info = tarfile.TarInfo(member)
        if member == "link":
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 3
            tar.addfile(info, io.BytesIO(b"bad"))
    store = _fresh(tmp_path, "s")
    with pytest.raises(IntegrityError, match="refusing"):
        import_pack(store, pack)
    assert not (tmp_path / "evil").exists()
    assert store.tags.read() == {}


def test_not_a_tar_is_refused(tmp_path: Path):
    junk = tmp_path / "junk.pack"
    junk.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ForkdError):
        import_pack(_fresh(tmp_path, "s"), junk)


def _bomb_pack(store: Store, tmp_path: Path, payload: bytes) -> Path:
    """A pack whose one memory chunk is ``payload`` while its map declares one 2 MiB chunk
    (``payload`` within the stored bound of one: imagemap.max_stored)."""
    blobs: dict[str, bytes] = {}

    def put(data: bytes) -> str:
        d = dg.of_bytes(data)
        blobs[d] = data
        return d

    chunk_digest = put(payload)
    imap = {
        "version": 1,
        "kind": "flat",
        "size": CHUNK_SIZE,
        "page_size": 4096,
        "zero": [],
        "chunks": [
            {
                "digest": chunk_digest,
                "blake3": "0" * 64,
                "size": CHUNK_SIZE,
                "stored": len(payload),
                "extents": [[0, CHUNK_SIZE // 4096]],
            }
        ],
    }
    map_bytes = json.dumps(imap).encode()
    cfg = {
        "schema": 1,
        "tag": "bomb:latest",
        "parent_tag": None,
        "parent_digest": None,
        "depth": 0,
        "memory_size": CHUNK_SIZE,
        "disk_size": None,
        "page_size": 4096,
        "compat": None,
        "created_at": "2026-01-01T00:00:00Z",
        "description": "",
        "recipe": None,
        "compacted_from": None,
        "extra": {},
    }
    cfg_bytes = json.dumps(cfg).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "artifactType": mt.ARTIFACT_TYPE,
        "config": {"mediaType": mt.CONFIG, "digest": put(cfg_bytes), "size": len(cfg_bytes)},
        "layers": [
            {"mediaType": mt.MEMORY_MAP, "digest": put(map_bytes), "size": len(map_bytes)},
            {"mediaType": mt.MEMORY_CHUNK, "digest": chunk_digest, "size": len(payload)},
        ],
    }
    man_bytes = json.dumps(manifest).encode()
    man_digest = put(man_bytes)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": mt.OCI_MANIFEST,
                "digest": man_digest,
                "size": len(man_bytes),
                "annotations": {mt.ANNOTATION_REF_NAME: "bomb:latest"},
            }
        ],
    }
    pack = tmp_path / "bomb.pack"
    with tarfile.open(pack, "w") as tar:
        for name, data in [
            ("index.json", json.dumps(index).encode()),
            *((f"blobs/sha256/{dg.hex_part(d)}", b) for d, b in blobs.items()),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return pack


def test_decompression_bomb_refused(tmp_path: Path):
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))
    assert len(bomb) < 64 << 10
    store = _fresh(tmp_path, "s")
    with pytest.raises(IntegrityError, match="frame declares 268435456 bytes"):
        import_pack(store, _bomb_pack(store, tmp_path, bomb))
    assert store.tags.read() == {}
    # A frame without a declared size is cut off at the map's size.
    streaming = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    unsized = streaming.compress(bytes(64 << 20)) + streaming.flush()
    with pytest.raises(IntegrityError):
        decompress(unsized, 4096, "chunk")


def test_oversized_manifest_refused():
    with pytest.raises(IntegrityError, match="over the"):
        Manifest.from_bytes(b"{" + b" " * MAX_MANIFEST_BYTES + b"}")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: m.update(size=4097), "multiple of 4096"),
        (lambda m: m["chunks"][0].update(extents=[[600, 1]]), "past the image"),
        (lambda m: m["chunks"][0].update(size=8192), "declares"),
        (lambda m: m.update(zero=[[0, 1]]), "flat map cannot list zero"),
        (lambda m: m.update(version=9), "unsupported"),
        (lambda m: m["chunks"][0].update(digest="sha256:../../x"), "invalid digest"),
    ],
)
def test_image_map_validation(change, message):  # type: ignore[no-untyped-def]
    doc = {
        "version": 1,
        "kind": "flat",
        "size": CHUNK_SIZE,
        "page_size": 4096,
        "zero": [],
        "chunks": [
            {
                "digest": dg.of_bytes(b"x"),
                "blake3": "0" * 64,
                "size": 4096,
                "stored": 10,
                "extents": [[0, 1]],
            }
        ],
    }
    ImageMap.from_bytes(json.dumps(doc).encode())
    change(doc)
    with pytest.raises((IntegrityError, InvalidInput), match=message):
        ImageMap.from_bytes(json.dumps(doc).encode())


def test_overlapping_extents_refused():
    doc = {
        "version": 1,
        "kind": "diff",
        "size": CHUNK_SIZE,
        "page_size": 4096,
        "zero": [[1, 1]],
        "chunks": [
            {
                "digest": dg.of_bytes(b"x"),
                "blake3": "0" * 64,
                "size": 8192,
                "stored": 10,
                "extents": [[0, 2]],
            }
        ],
    }
    with pytest.raises(IntegrityError, match="provided twice"):
        ImageMap.from_bytes(json.dumps(doc).encode())
