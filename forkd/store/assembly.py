"""A chain head's images out of the store: its maps flattened and its chunks written once
into ``cache/<hex>/`` (memory.img, disk.img), then served from there; and the chain's
whole-file blobs (vmstate, kernel, initrd) as local files. Blobs are read through the
``BlobStore`` protocol only: over a backend that keeps no local files, a file blob is
copied (verified) into the cache next to the images."""

from __future__ import annotations

import contextlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forkd import digest as dg
from forkd.errors import ForkdError, IntegrityError, InvalidInput, NotFound
from forkd.pack.chain import Link, flatten
from forkd.pack.chunking import Progress, decompress
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import PAGE_SIZE, ImageMap
from forkd.pack.manifest import Descriptor
from forkd.store.blobs import COPY_SIZE, BlobBackendError, StreamCheck, local_path
from forkd.store.manifests import chain_files

if TYPE_CHECKING:
    from forkd.store.store import Store

IMAGE_ROLES = ("memory", "disk")


@dataclass(frozen=True)
class Assembled:
    """A chain head's images, ready to map: treat every path as read-only."""

    digest: str
    config: SnapshotConfig
    memory: Path
    disk: Path | None
    vmstate: Path | None
    files: dict[str, Path] = field(default_factory=dict)


def cache_of(store: Store, digest: str) -> Path:
    """The directory of manifest ``digest``'s assembled images."""
    return store.cache_dir / dg.hex_part(digest)


def assemble(
    store: Store, digest: str, name: str = "", progress: Progress | None = None
) -> Assembled:
    """Images and files of a chain head, from the cache or written once."""
    name = name or digest
    chain = store.chain(digest, name)
    config = store.config(digest)
    files = {role: _file(store, digest, role, d, name) for role, d in chain_files(chain).items()}
    images = assemble_images(store, digest, name, progress, chain)
    return Assembled(
        digest, config, images["memory"], images.get("disk"), files.pop("vmstate", None), files
    )


def assemble_images(
    store: Store,
    digest: str,
    name: str = "",
    progress: Progress | None = None,
    chain: list[Link] | None = None,
) -> dict[str, Path]:
    """The head's images by role (memory, and disk when the chain has one)."""
    name = name or digest
    chain = chain if chain is not None else store.chain(digest, name)
    images: dict[str, Path] = {}
    for role in IMAGE_ROLES:
        if not any(role in link.manifest.maps for link in chain):
            continue
        target = cache_of(store, digest) / f"{role}.img"
        if not target.exists():
            maps = chain_maps(store, chain, role, name)
            _write_image(store, chain, role, maps, target, name, progress)
        images[role] = target
    if "memory" not in images:
        raise IntegrityError(f"{name}: the chain provides no memory image")
    return images


def chain_maps(store: Store, chain: list[Link], role: str, name: str) -> list[ImageMap]:
    """The ``role`` maps of the chain, head first, down to (and with) the first flat one."""
    maps: list[ImageMap] = []
    for i, link in enumerate(chain):
        imap = store.image_map(link.manifest, role, f"{name} layer {i} ({link.digest})")
        if imap is None:
            if role == "memory":
                raise IntegrityError(f"{name}: layer {i} ({link.digest}) has no memory map")
            continue
        maps.append(imap)
        if imap.kind == "flat":
            break
    return maps


def missing_file(name: str, role: str, digest: str) -> str:
    return (
        f"{name}: the {role} blob {digest} is missing from the store; pull or import the pack again"
    )


def check_files(store: Store, chain: list[Link], name: str) -> None:
    """Refuse a chain whose whole-file blobs are not all in the store."""
    for role, d in chain_files(chain).items():
        if not store.blobs.has(d.digest):
            raise NotFound(missing_file(name, role, d.digest))


def _file(store: Store, head: str, role: str, d: Descriptor, name: str) -> Path:
    """A local file holding the chain's ``role`` blob: the blob's own file, or a verified
    copy in the head's cache directory."""
    missing = missing_file(name, role, d.digest)
    own = local_path(store.blobs, d.digest)
    if own is not None:
        if not own.is_file():
            raise NotFound(missing)
        return own
    target = cache_of(store, head) / role
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{role}-")
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                src = store.blobs.open(d.digest)
            except NotFound:
                raise NotFound(missing) from None
            with src:
                check = StreamCheck(d.digest, d.size)
                for chunk in check.feed(iter(lambda: src.read(COPY_SIZE), b"")):
                    out.write(chunk)
                check.finish()
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


def _check_written(store: Store, written: int, where: Path, what: str) -> None:
    """Refuse an image whose maps make it write ``written`` bytes into ``where`` past the
    store's bound or the free space there (2 MiB of one byte is stored in a few dozen: a
    small pack can declare a TiB), before a byte is written."""
    from forkd.store.fetch import check_room  # (fetch imports the store, which imports this)

    if store.max_written is not None and written > store.max_written:
        raise InvalidInput(
            f"{what} would get {written} bytes written, over the limit of "
            f"{store.max_written} bytes here; flatten it where it was made (forkd compact) "
            "and push the flat layer"
        )
    check_room(store, written, what, where)


def _write_image(
    store: Store,
    chain: list[Link],
    role: str,
    maps: list[ImageMap],
    target: Path,
    name: str,
    progress: Progress | None,
) -> None:
    plan = flatten(maps, f"{name} {role}")
    target.parent.mkdir(parents=True, exist_ok=True)
    _check_written(store, sum(p.count for _, pieces in plan for p in pieces) * PAGE_SIZE,
                   target.parent, f"{name}: its {role} image")
    label: dict[str, str] = {}
    for i, link in reversed(list(enumerate(chain))):
        for d in link.manifest.chunks:
            label[d.digest] = f"layer {i} ({dg.short(link.digest)})"
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{role}-")
    try:
        os.ftruncate(fd, maps[0].size)

        def place(item: tuple[Any, list[Any]]) -> None:
            chunk, pieces = item
            what = f"{name}: {label.get(chunk.digest, 'a layer')}, {role} chunk {chunk.digest}"
            try:
                blob = store.blobs.read(chunk.digest, chunk.stored, what)
            except (NotFound, BlobBackendError):
                raise  # missing or unreachable, not corrupt: the message says which
            except OSError as exc:  # the disk failed a read: not the blob's fault either
                raise BlobBackendError(f"{what}: cannot be read: {exc}") from exc
            except ForkdError as exc:
                raise IntegrityError(f"{what}: {exc}") from exc
            data = memoryview(decompress(blob, chunk.size, what))
            for p in pieces:
                os.pwrite(
                    fd,
                    data[p.chunk_page * PAGE_SIZE : (p.chunk_page + p.count) * PAGE_SIZE],
                    p.page * PAGE_SIZE,
                )
            if progress:
                progress(chunk.size)

        with ThreadPoolExecutor(max_workers=2) as pool:
            for _ in pool.map(place, plan):
                pass
        os.fchmod(fd, 0o444)
        os.close(fd)
        fd = -1
        os.replace(tmp, target)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
