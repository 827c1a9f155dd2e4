"""Packs as files: a chain head and its ancestors as one OCI image-layout tar.

Export writes ``oci-layout``, ``index.json`` (one entry per chain member, each
named by its tag in ``org.opencontainers.image.ref.name``, head first) and
``blobs/sha256/<hex>``. Import reads an untrusted tar: only those member names,
plain regular files only (no sparse members, links or devices), each member
inside the archive and all of them together no bigger than it, so an import
writes at most the bytes the pack carries; every blob is checked against its digest as
it is stored, every manifest, config and map is validated, every chunk is
decompressed (bounded) and checked against its blake3; tags are written last,
and only when all of that passed.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import ChainError, Conflict, ForkdError, IntegrityError, InvalidInput
from forkd.names import Ref, matches, parse_ref, whole
from forkd.pack import mediatypes as mt
from forkd.pack.chain import MAX_CHAIN_DEPTH
from forkd.pack.manifest import MAX_MANIFEST_BYTES
from forkd.store.blobs import put_file
from forkd.store.fetch import Want, fetch_chain
from forkd.store.store import Store

_BLOB_NAME = whole(r"blobs/sha256/([a-f0-9]{64})")
_DIRS = ("", "blobs", "blobs/sha256", "blobs/", "blobs/sha256/")
# Plain files only: tarfile counts GNU sparse and contiguous members as files too.
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)
MAX_INDEX_BYTES = 4 << 20

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ImportedPack:
    head: str
    tags: list[str]
    skipped_tags: list[str]
    blobs: int


def export_pack(store: Store, ref: str, out: Path, progress: Progress | None = None) -> int:
    """Write ``ref`` and its ancestors to ``out`` (atomically); returns the bytes of blobs."""
    key = parse_ref(ref)
    head = store.resolve(key)
    chain = store.chain(head, str(key))
    entries = []
    blobs: dict[str, int] = {}
    for i, link in enumerate(chain):
        name = str(key) if i == 0 else store.config(link.digest).tag
        data = store.blobs.read(link.digest, MAX_MANIFEST_BYTES, "manifest")
        entries.append(
            {
                "mediaType": mt.OCI_MANIFEST,
                "digest": link.digest,
                "size": len(data),
                "artifactType": mt.ARTIFACT_TYPE,
                "annotations": {mt.ANNOTATION_REF_NAME: name},
            }
        )
        blobs[link.digest] = len(data)
        for d in link.manifest.blobs():
            blobs[d.digest] = d.size
    index = json.dumps(
        {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": entries}, indent=2
    ).encode()
    layout = json.dumps({"imageLayoutVersion": mt.OCI_LAYOUT_VERSION}).encode()
    tmp = out.with_name(f".{out.name}.partial")
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, "oci-layout", layout)
            for digest in sorted(blobs):
                with store.blobs.open(digest) as f:
                    info = tarfile.TarInfo(f"blobs/sha256/{dg.hex_part(digest)}")
                    info.size = blobs[digest]
                    info.mode = 0o444
                    tar.addfile(info, f)
                if progress:
                    progress(blobs[digest])
            _add_bytes(tar, "index.json", index)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return sum(blobs.values())


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o444
    tar.addfile(info, io.BytesIO(data))


def import_pack(
    store: Store, path: Path, force: bool = False, progress: Progress | None = None
) -> ImportedPack:
    try:
        tar = tarfile.open(path, "r:")  # noqa: SIM115 - closed by the `with` below
    except (OSError, tarfile.TarError) as exc:
        raise InvalidInput(
            f"{path} is not a readable pack (an OCI image-layout tar): {exc}"
        ) from exc
    with tar, store.writing():
        members = _check_members(tar, path, _archive_size(tar))
        if "index.json" not in members:
            raise IntegrityError(f"{path}: no index.json; not an OCI image layout")
        index = _read_member(tar, members["index.json"], MAX_INDEX_BYTES, "index.json")
        heads = _parse_index(index, path)
        blob_members = {
            f"sha256:{match.group(1)}": info
            for name, info in members.items()
            if (match := _BLOB_NAME.fullmatch(name))
        }

        def fetch(wants: list[Want]) -> None:
            for want in wants:
                info = blob_members.get(want.digest)
                if info is None:
                    raise IntegrityError(f"{path}: {want.what} is missing from the pack")
                if info.size > want.limit or want.size not in (None, info.size):
                    raise IntegrityError(
                        f"{path}: {want.what} is {info.size} bytes, expected "
                        f"{want.size if want.size is not None else f'at most {want.limit}'}"
                    )
                f = tar.extractfile(info)
                assert f is not None
                try:
                    put_file(store.blobs, f, want.digest, info.size)
                except IntegrityError as exc:
                    raise IntegrityError(f"{path}: {want.what}: {exc}") from exc
                if progress:
                    progress(info.size)

        count = 0
        for name, head in heads:
            for link in fetch_chain(store, head, str(name), fetch):
                count += sum(1 for _ in link.manifest.chunks)
        return _tag(store, heads, force, count)


def _tag(store: Store, heads: list[tuple[Ref, str]], force: bool, count: int) -> ImportedPack:
    tagged: list[str] = []
    skipped: list[str] = []

    def change(tags: dict[str, str]) -> None:
        head_name, head_digest = heads[0]
        if not force and tags.get(str(head_name), head_digest) != head_digest:
            raise Conflict(f"tag {head_name} exists with other content; pass --force to replace it")
        for i, (name, digest) in enumerate(heads):
            current = tags.get(str(name))
            if i > 0 and current not in (None, digest):
                skipped.append(str(name))  # an ancestor's old tag is taken: keep the local one
                continue
            tags[str(name)] = digest
            tagged.append(str(name))

    store.tags.update(change)
    return ImportedPack(str(heads[0][0]), tagged, skipped, count)


def _check_members(
    tar: tarfile.TarFile, path: Path, archive_size: int
) -> dict[str, tarfile.TarInfo]:
    """The pack's files by name, each a plain file whose bytes lie inside the archive."""
    members: dict[str, tarfile.TarInfo] = {}
    carried = 0
    for info in _members(tar, path):
        name = info.name.removeprefix("./")
        if info.type == tarfile.DIRTYPE and name in _DIRS:
            continue
        shown = repr(info.name[:200])
        if info.type not in _FILE_TYPES or info.issparse():
            raise IntegrityError(
                f"{path}: member {shown} is not a plain regular file (sparse, link, device or "
                "directory); refusing — re-export the pack with `forkd export`"
            )
        if name not in ("oci-layout", "index.json") and not matches(_BLOB_NAME, name):
            raise IntegrityError(f"{path}: unexpected member {shown}; refusing")
        if name in members:
            raise IntegrityError(f"{path}: member {shown} appears twice; refusing")
        carried += info.size
        if info.offset_data + info.size > archive_size or carried > archive_size:
            raise IntegrityError(
                f"{path}: member {shown} declares {info.size} bytes, more than the "
                f"{archive_size}-byte pack holds; refusing (truncated or hostile pack)"
            )
        members[name] = info
    return members


def _archive_size(tar: tarfile.TarFile) -> int:
    """The bytes of the opened pack file (0 for a pipe or device: nothing fits in it)."""
    opened = cast(BinaryIO, tar.fileobj)  # tarfile.open(path) keeps the file it opened
    return os.fstat(opened.fileno()).st_size


def _members(tar: tarfile.TarFile, path: Path) -> list[tarfile.TarInfo]:
    """Every member header; a header tarfile cannot parse is an IntegrityError."""
    try:
        return tar.getmembers()
    except (tarfile.TarError, ValueError, EOFError, OSError) as exc:
        raise IntegrityError(f"{path}: a tar header is damaged ({exc}); refusing") from exc


def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo, limit: int, what: str) -> bytes:
    if info.size > limit:
        raise IntegrityError(f"{what} is {info.size} bytes, over the {limit}-byte limit")
    f = tar.extractfile(info)
    assert f is not None
    return f.read(limit + 1)


def _parse_index(data: bytes, path: Path) -> list[tuple[Ref, str]]:
    try:
        raw = jsondoc.loads(data, "index.json")
        entries = raw["manifests"]
        heads = []
        for e in entries:
            if e.get("mediaType") != mt.OCI_MANIFEST:
                raise IntegrityError(f"index entry {e.get('digest')} is not an image manifest")
            name = e.get("annotations", {}).get(mt.ANNOTATION_REF_NAME)
            if not isinstance(name, str):
                raise IntegrityError(f"index entry {e.get('digest')} has no ref name annotation")
            heads.append((parse_ref(name), dg.validate(e["digest"])))
    except ForkdError as exc:
        raise IntegrityError(f"{path}: index.json: {exc}") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"{path}: index.json is malformed: {exc!r}") from exc
    if not heads:
        raise IntegrityError(f"{path}: index.json lists no manifests")
    if len(heads) > MAX_CHAIN_DEPTH + 1:
        raise ChainError(f"{path}: {len(heads)} manifests, more than a chain may hold")
    return heads
