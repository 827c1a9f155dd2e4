"""Bytes per component of a chain (memory, disk, kernel, initrd, device state, config):
what `forkd inspect` reports. Stored bytes are those of the distinct blobs the chain's
manifests reference, each counted once, so the components add up to the chain's stored size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from forkd.pack import mediatypes as mt
from forkd.pack.chain import Link
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import ImageMap

COMPONENTS = ("memory", "disk", "kernel", "initrd", "vmstate", "config")
_ROLE_OF: dict[str, str] = {mt.CONFIG: "config"}
for _role, (_map_type, _chunk_type) in mt.IMAGE_ROLES.items():
    _ROLE_OF[_map_type] = _role
    _ROLE_OF[_chunk_type] = _role
for _role, _file_type in mt.FILE_ROLES.items():
    _ROLE_OF[_file_type] = _role

MapReader = Callable[[Link, str], ImageMap | None]


@dataclass
class ComponentBytes:
    stored_bytes: int = 0  # compressed, as kept in the store and sent by push/pull
    logical_bytes: int = 0  # images: the size the guest sees; files: the blob's bytes
    data_bytes: int = 0  # uncompressed bytes the stored blobs hold (images: non-zero pages)
    blobs: int = 0


def component_bytes(
    chain: list[Link], head: SnapshotConfig, read_map: MapReader
) -> dict[str, dict[str, int]]:
    """Per component of ``chain`` (head first): stored, logical and data bytes and blob count.

    A blob is counted once, under the first component that references it (memory, disk,
    kernel, initrd, vmstate, config), even when several layers or roles name it."""
    out = {name: ComponentBytes() for name in COMPONENTS}
    counted: set[str] = set()
    for link in chain:
        for d in link.manifest.blobs():
            if d.digest in counted:
                continue
            counted.add(d.digest)
            c = out[_ROLE_OF[d.media_type]]
            c.stored_bytes += d.size
            c.blobs += 1
            if d.media_type in _FILE_TYPES:
                c.logical_bytes += d.size
                c.data_bytes += d.size
    chunk_data: dict[str, int] = {}  # uncompressed bytes of each distinct chunk blob
    chunk_role: dict[str, str] = {}
    for link in chain:
        for role in mt.IMAGE_ROLES:
            imap = read_map(link, role)
            for chunk in imap.chunks if imap else ():
                chunk_data.setdefault(chunk.digest, chunk.size)
                chunk_role.setdefault(chunk.digest, role)
    for digest, size in chunk_data.items():
        out[chunk_role[digest]].data_bytes += size
    out["memory"].logical_bytes = head.memory_size
    out["disk"].logical_bytes = head.disk_size or 0
    return {name: asdict(c) for name, c in out.items()}


_FILE_TYPES = frozenset({mt.CONFIG, *mt.FILE_ROLES.values()})
