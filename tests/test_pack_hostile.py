"""Hostile pack files: sparse or lying tar members, names with control characters, deeply
nested JSON (issue 10 items 9, 10, 11). Every refusal leaves no tag, writes no more than
the pack carries, and ends `forkd import --pack` with a one-line message, no traceback."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput
from forkd.pack import mediatypes as mt
from forkd.store.packfile import import_pack
from forkd.store.store import Store

DEEP = 100_000
SPARSE_SIZE = 64 << 20  # what a sparse member would make an import write
DATA = b"x" * 4096  # the bytes a sparse member really carries


def deep_json(levels: int = DEEP) -> bytes:
    return b"[" * levels + b"]" * levels


def config_doc(tag: str) -> dict[str, object]:
    return {
        "schema": 1,
        "tag": tag,
        "parent_tag": None,
        "parent_digest": None,
        "depth": 0,
        "memory_size": 4096,
        "disk_size": None,
        "page_size": 4096,
        "compat": None,
        "created_at": "2026-01-01T00:00:00Z",
        "description": "",
        "recipe": None,
        "compacted_from": None,
        "extra": {},
    }


def snapshot(
    ref: str = "hostile:v1",
    *,
    config: bytes | None = None,
    memory_map: bytes | None = None,
    manifest: bytes | None = None,
    vmstate: tuple[str, int] | None = None,
) -> dict[str, bytes]:
    """The members of a one-layer pack (name → bytes): a flat 4 KiB memory image with no
    chunks; any document may be replaced, a vmstate file (digest, size) may be listed."""
    blobs: dict[str, bytes] = {}

    def put(data: bytes) -> str:
        d = dg.of_bytes(data)
        blobs[f"blobs/sha256/{dg.hex_part(d)}"] = data
        return d

    tag_of_config = ref if ":" in ref else f"{ref}:latest"
    cfg = config if config is not None else json.dumps(config_doc(tag_of_config)).encode()
    imap = (
        memory_map
        if memory_map is not None
        else json.dumps(
            {
                "version": 1,
                "kind": "flat",
                "size": 4096,
                "page_size": 4096,
                "chunks": [],
                "zero": [],
            }
        ).encode()
    )
    layers = [{"mediaType": mt.MEMORY_MAP, "digest": put(imap), "size": len(imap)}]
    if vmstate is not None:
        layers.append({"mediaType": mt.VMSTATE, "digest": vmstate[0], "size": vmstate[1]})
    man = manifest
    if man is None:
        man = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": mt.OCI_MANIFEST,
                "artifactType": mt.ARTIFACT_TYPE,
                "config": {"mediaType": mt.CONFIG, "digest": put(cfg), "size": len(cfg)},
                "layers": layers,
            }
        ).encode()
    index = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_INDEX,
        "manifests": [
            {
                "mediaType": mt.OCI_MANIFEST,
                "digest": put(man),
                "size": len(man),
                "annotations": {mt.ANNOTATION_REF_NAME: ref},
            }
        ],
    }
    return {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": json.dumps(index).encode(),
        **blobs,
    }


def write_pack(path: Path, members: dict[str, bytes], fmt: int = tarfile.PAX_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def forkd(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["forkd", *args],
        env={**os.environ, "FORKD_HOME": str(home)},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


def refused(proc: subprocess.CompletedProcess[str], exit_code: int, *words: str) -> None:
    """The command failed with ``exit_code`` and one `forkd: error:` line, no traceback."""
    assert proc.returncode == exit_code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forkd: error: "), proc.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def stored_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in home.rglob("*") if p.is_file())


def no_tags(home: Path) -> bool:
    return Store.open(home).tags.read() == {}


def sparse_digest() -> str:
    """sha256 of DATA followed by zeros up to SPARSE_SIZE: what the sparse member expands to."""
    h = hashlib.sha256(DATA)
    zeros = bytes(1 << 20)
    left = SPARSE_SIZE - len(DATA)
    while left:
        n = min(left, len(zeros))
        h.update(zeros[:n])
        left -= n
    return "sha256:" + h.hexdigest()


# -- item 10: sparse members ---------------------------------------------------------
def _pax_sparse_member(name: str, sparse_map: bytes, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    """A GNU sparse 1.0 member in PAX format, built with the stdlib: the map of data
    regions heads the member's data; ``realsize`` is what extraction produces."""
    block = sparse_map + bytes(-len(sparse_map) % tarfile.BLOCKSIZE)
    info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": name,
        "GNU.sparse.realsize": str(SPARSE_SIZE),
    }
    payload = block + data
    info.size = len(payload)
    return info, payload


def _stdlib_sparse_pack(path: Path, sparse_map: bytes) -> Path:
    digest = sparse_digest()
    members = snapshot(vmstate=(digest, SPARSE_SIZE))
    name = f"blobs/sha256/{dg.hex_part(digest)}"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info, payload = _pax_sparse_member(name, sparse_map, DATA)
        tar.addfile(info, io.BytesIO(payload))
    return path


def test_pax_sparse_member_is_refused_without_writing(tmp_path: Path) -> None:
    pack = _stdlib_sparse_pack(tmp_path / "sparse.pack", f"1\n0\n{len(DATA)}\n".encode())
    with tarfile.open(pack) as tar:  # the member really expands to SPARSE_SIZE bytes
        assert any(m.issparse() and m.size == SPARSE_SIZE for m in tar.getmembers())
    assert pack.stat().st_size < 64 << 10
    home = tmp_path / "home"
    refused(forkd(home, "import", "--pack", str(pack)), IntegrityError.exit_code, "sparse")
    assert no_tags(home)
    assert stored_bytes(home) < pack.stat().st_size


def test_damaged_sparse_map_is_refused(tmp_path: Path) -> None:
    pack = _stdlib_sparse_pack(tmp_path / "bad-map.pack", b"not-a-number\n")
    home = tmp_path / "home"
    refused(forkd(home, "import", "--pack", str(pack)), IntegrityError.exit_code, "refusing")
    assert no_tags(home)


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
@pytest.mark.parametrize(
    "options",
    [
        ["--format=gnu"],
        ["--format=posix", "--sparse-version=0.1"],
        ["--format=posix", "--sparse-version=1.0"],
    ],
    ids=["gnu", "pax-0.1", "pax-1.0"],
)
def test_gnu_tar_sparse_pack_is_refused_without_writing(tmp_path: Path, options: list[str]) -> None:
    """A pack made by GNU tar --sparse from a file with a hole (truncate)."""
    layout = tmp_path / "layout"
    digest = sparse_digest()
    for name, data in snapshot(vmstate=(digest, SPARSE_SIZE)).items():
        (layout / name).parent.mkdir(parents=True, exist_ok=True)
        (layout / name).write_bytes(data)
    hole = layout / "blobs" / "sha256" / dg.hex_part(digest)
    with open(hole, "wb") as f:
        f.write(DATA)
        f.truncate(SPARSE_SIZE)
    pack = tmp_path / "sparse.pack"
    subprocess.run(
        [
            "tar",
            "--sparse",
            *options,
            "-cf",
            str(pack),
            "-C",
            str(layout),
            "oci-layout",
            "index.json",
            "blobs",
        ],
        check=True,
    )
    assert pack.stat().st_size < 1 << 20
    home = tmp_path / "home"
    refused(forkd(home, "import", "--pack", str(pack)), IntegrityError.exit_code, "sparse")
    assert no_tags(home)
    assert stored_bytes(home) < pack.stat().st_size


def test_truncated_pack_is_refused_in_one_line(tmp_path: Path) -> None:
    """A truncated (or lying) pack: a member's header claims bytes the file does not hold."""
    data = os.urandom(1 << 20)
    digest = dg.of_bytes(data)
    members = snapshot(vmstate=(digest, len(data)))
    members[f"blobs/sha256/{dg.hex_part(digest)}"] = data  # last member
    pack = write_pack(tmp_path / "whole.pack", members)
    cut = tmp_path / "cut.pack"
    cut.write_bytes(pack.read_bytes()[: pack.stat().st_size - (len(data) // 2) - 10240])
    home = tmp_path / "home"
    refused(forkd(home, "import", "--pack", str(cut)), IntegrityError.exit_code, "refusing")
    assert no_tags(home)


def test_duplicate_members_are_refused(tmp_path: Path) -> None:
    members = snapshot()
    pack = tmp_path / "dup.pack"
    with tarfile.open(pack, "w") as tar:
        for name, data in [*members.items(), ("index.json", members["index.json"])]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    store = Store.open(tmp_path / "home")
    with pytest.raises(IntegrityError, match="appears twice"):
        import_pack(store, pack)
    assert store.tags.read() == {}


@pytest.mark.parametrize(
    "kind", [tarfile.CONTTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.LNKTYPE]
)
def test_members_of_other_types_are_refused(tmp_path: Path, kind: bytes) -> None:
    members = snapshot()
    pack = tmp_path / "odd.pack"
    with tarfile.open(pack, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if name.startswith("blobs/") and json.loads(data).get("kind") == "flat":
                info.type = kind
                info.linkname = "index.json" if kind == tarfile.LNKTYPE else ""
            tar.addfile(info, io.BytesIO(data))
    store = Store.open(tmp_path / "home")
    with pytest.raises(IntegrityError, match="not a plain regular file"):
        import_pack(store, pack)
    assert store.tags.read() == {}


def test_a_good_hand_made_pack_imports(tmp_path: Path) -> None:
    """The helpers above build packs forkd accepts: each refusal is about its one defect."""
    digest = dg.of_bytes(DATA)
    members = snapshot(vmstate=(digest, len(DATA)))
    members[f"blobs/sha256/{dg.hex_part(digest)}"] = DATA
    home = tmp_path / "home"
    proc = forkd(home, "import", "--pack", str(write_pack(tmp_path / "good.pack", members)))
    assert proc.returncode == 0, proc.stderr
    assert set(Store.open(home).tags.read()) == {"hostile:v1"}


# -- item 9: names with control characters in a pack -----------------------------------
@pytest.mark.parametrize("ref", ["nl:v1\n", "nl\n:v1", "nl:v1\r", "n\u0430me:v1", "nl:v1\u2028"])
def test_pack_tag_with_control_or_lookalike_character_is_refused(tmp_path: Path, ref: str) -> None:
    pack = write_pack(tmp_path / "nl.pack", snapshot(ref))
    home = tmp_path / "home"
    refused(forkd(home, "import", "--pack", str(pack)), IntegrityError.exit_code, "invalid")
    assert no_tags(home)


def test_config_tag_with_newline_is_refused(tmp_path: Path) -> None:
    config = json.dumps(config_doc("nl:v1\n")).encode()
    pack = write_pack(tmp_path / "cfg.pack", snapshot("nl:v1", config=config))
    home = tmp_path / "home"
    refused(forkd(home, "import", "--pack", str(pack)), InvalidInput.exit_code, "invalid tag")
    assert no_tags(home)


# -- item 11: deeply nested JSON ----------------------------------------------------------
@pytest.mark.parametrize(
    "document,exit_code",
    [
        ("config", InvalidInput.exit_code),
        ("manifest", InvalidInput.exit_code),
        ("memory_map", InvalidInput.exit_code),
        ("index", IntegrityError.exit_code),  # index.json problems are the pack's integrity
    ],
)
def test_deeply_nested_document_is_refused_in_one_line(
    tmp_path: Path, document: str, exit_code: int
) -> None:
    if document == "index":
        members = snapshot()
        members["index.json"] = deep_json()
    else:
        members = snapshot(**{document: deep_json()})  # type: ignore[arg-type]
    pack = write_pack(tmp_path / "deep.pack", members)
    home = tmp_path / "home"
    refused(forkd(home, "import", "--pack", str(pack)), exit_code, f"nests {DEEP} levels deep")
    assert no_tags(home)


def test_deeply_nested_tag_index_is_an_integrity_error(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "home")
    store.tags.path.write_bytes(b'{"a:b": ' + deep_json() + b"}")
    with pytest.raises(IntegrityError, match="nests"):
        store.tags.read()
