"""A layer's manifest written from its config, maps and files (the one place that builds
one), and what a chain's manifests say about its whole-file blobs."""

from __future__ import annotations

from datetime import UTC, datetime

from forkd.pack import mediatypes as mt
from forkd.pack.chain import Link
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import ImageMap
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Descriptor, Manifest
from forkd.store.blobs import BlobStore


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_manifest(
    blobs: BlobStore,
    cfg: SnapshotConfig,
    memory_map: ImageMap,
    disk_map: ImageMap | None,
    files: dict[str, Descriptor],
    parent: Link | None,
    extra_annotations: dict[str, str] | None = None,
) -> str:
    """Store the config, the maps and the manifest naming them (and ``parent`` as its
    subject); the chunks are stored already. Returns the manifest's digest. A config that
    would not read back (``SnapshotConfig.validate``: a description with a line break) is
    refused here, before anything names it, not found unreadable later."""
    cfg.validate("config")
    config_bytes = cfg.to_bytes()
    config = Descriptor(mt.CONFIG, blobs.put_bytes(config_bytes), len(config_bytes))
    maps: dict[str, Descriptor] = {}
    chunks: list[Descriptor] = []
    seen: set[tuple[str, str]] = set()
    for role, imap in (("memory", memory_map), ("disk", disk_map)):
        if imap is None:
            continue
        data = imap.to_bytes()
        map_type, chunk_type = mt.IMAGE_ROLES[role]
        maps[role] = Descriptor(map_type, blobs.put_bytes(data), len(data))
        for c in imap.chunks:
            if (chunk_type, c.digest) not in seen:
                seen.add((chunk_type, c.digest))
                chunks.append(Descriptor(chunk_type, c.digest, c.stored))
    annotations = {mt.ANNOTATION_CREATED: cfg.created_at}
    subject = None
    if parent is not None:
        data = blobs.read(parent.digest, MAX_MANIFEST_BYTES, "manifest")
        subject = Descriptor(mt.OCI_MANIFEST, parent.digest, len(data))
        assert cfg.parent_tag is not None
        annotations[mt.ANNOTATION_PARENT_TAG] = cfg.parent_tag
    annotations.update(extra_annotations or {})
    manifest = Manifest(config, maps, tuple(chunks), files, subject, annotations)
    return blobs.put_bytes(manifest.to_bytes())


def chain_files(chain: list[Link]) -> dict[str, Descriptor]:
    """The whole-file blobs (vmstate, kernel, initrd) of a chain: the newest layer's wins."""
    files: dict[str, Descriptor] = {}
    for link in reversed(chain):
        files.update(link.manifest.files)
    return files
