"""A chain flattened into one flat layer with the head's assembled bytes. Unchanged 2 MiB
regions keep the chunks the chain stores; only regions the diffs changed become new chunks.
The hub's server-side compaction runs ``flatten`` on a scratch store over its own blobs."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from forkd.errors import Conflict
from forkd.names import parse_ref
from forkd.pack import mediatypes as mt
from forkd.pack.chain import flatten as flatten_maps
from forkd.pack.chain import written_extents
from forkd.pack.chunking import ZSTD_LEVEL, build_map, flat_chunks, image_size, known_chunks
from forkd.pack.config import Provenance
from forkd.pack.imagemap import ImageMap
from forkd.store.assembly import assemble_images, cache_of, chain_maps, check_files
from forkd.store.listing import LayerInfo, layer_info
from forkd.store.manifests import chain_files, now, write_manifest

if TYPE_CHECKING:
    from forkd.store.store import Store


def compact(store: Store, ref: str, to: str, force: bool = False) -> LayerInfo:
    """Tag ``to`` a flat layer of ``ref``'s chain (``forkd compact``)."""
    source, target = parse_ref(ref), parse_ref(to)
    if not force and str(target) in store.tags.read():
        raise Conflict(f"tag {target} exists; pick another tag or pass --force")
    with store.writing():
        digest = store.resolve(source)
        cfg = store.config(digest)
        new = flatten(
            store, digest, str(target), Provenance(str(source), digest, cfg.depth, "manual")
        )
        store.set_tag(target, new, force)
    return layer_info(store, target, new)


def flatten(store: Store, digest: str, tag: str, provenance: Provenance) -> str:
    """One flat layer with the head's assembled bytes; returns its manifest digest.

    Only the pages some layer's chunk wrote are read back: the rest of the assembled
    image is holes (zero), so the work follows the stored chunks, not the image size
    the maps declare."""
    chain = store.chain(digest)
    check_files(store, chain, digest)  # the new layer names them too
    images = assemble_images(store, digest, chain=chain)
    maps: dict[str, ImageMap] = {}
    for role, path in images.items():
        old_maps = chain_maps(store, chain, role, digest)
        plan = flatten_maps(old_maps, f"{digest} {role}")
        with open(path, "rb") as f:
            size = image_size(f, f"assembled {role} image")
            chunks = flat_chunks(f, size, written=written_extents(plan))
            # unchanged regions keep their stored chunks; new ones get the fast level
            maps[role] = build_map(
                store.blobs,
                "flat",
                size,
                chunks,
                [],
                level=ZSTD_LEVEL,
                reuse=known_chunks(old_maps),
            )
    cfg = replace(
        store.config(digest),
        tag=tag,
        parent_tag=None,
        parent_digest=None,
        depth=0,
        created_at=now(),
        compacted_from=provenance,
    )
    new = write_manifest(
        store.blobs,
        cfg,
        maps["memory"],
        maps.get("disk"),
        chain_files(chain),
        None,
        {mt.ANNOTATION_COMPACTED_FROM: f"{provenance.from_tag}@{provenance.from_digest}"},
    )
    share_cache(store, images, new)
    return new


def share_cache(store: Store, images: dict[str, Path], new: str) -> None:
    """Same bytes by construction: the head's cached images serve the new digest too."""
    new_cache = cache_of(store, new)
    if new_cache.exists():
        return
    tmp = Path(tempfile.mkdtemp(dir=store.cache_dir, prefix=".link-"))
    for role, path in images.items():
        os.link(path, tmp / f"{role}.img")
    try:
        os.rename(tmp, new_cache)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
