"""What the store holds, as ``forkd images`` and ``forkd inspect`` report it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forkd.names import Ref, parse_ref
from forkd.store.sizes import component_bytes

if TYPE_CHECKING:
    from forkd.store.store import Store


@dataclass(frozen=True)
class LayerInfo:
    ref: str
    digest: str
    depth: int
    memory_size: int
    stored_bytes: int  # bytes of blobs this layer references (own maps, chunks, files)
    new_pages: int  # pages this layer provides (diff: changed pages)
    compacted: bool


def layer_info(store: Store, ref: Ref, digest: str) -> LayerInfo:
    """What `images` lists; compacted: the layer's config records where it was flattened
    from (local, automatic or hub-side compaction; the config travels with push/pull)."""
    m = store.manifest(digest)
    cfg = store.config(digest)
    imap = store.image_map(m, "memory", str(ref))
    assert imap is not None
    return LayerInfo(
        str(ref),
        digest,
        cfg.depth,
        cfg.memory_size,
        sum(d.size for d in m.blobs()),
        imap.provided_pages,
        cfg.compacted_from is not None,
    )


def images(store: Store) -> list[LayerInfo]:
    return [
        layer_info(store, parse_ref(name), digest)
        for name, digest in sorted(store.tags.read().items())
    ]


def inspect(store: Store, ref: str) -> dict[str, Any]:
    key = parse_ref(ref)
    digest = store.resolve(key)
    chain = store.chain(digest, str(key))
    cfg = store.config(digest)
    unique: dict[str, int] = {}
    layers = []
    for i, link in enumerate(chain):
        link_cfg = store.config(link.digest)
        own = sum(d.size for d in link.manifest.blobs())
        for d in link.manifest.blobs():
            unique[d.digest] = d.size
        layers.append(
            {
                "position": i,
                "tag": link_cfg.tag,
                "digest": link.digest,
                "depth": link_cfg.depth,
                "stored_bytes": own,
            }
        )
    logical = cfg.memory_size + (cfg.disk_size or 0)
    stored = sum(unique.values())
    m = chain[0].manifest
    return {
        "ref": str(key),
        "digest": digest,
        "config": json.loads(cfg.to_bytes()),
        "layers": [d.to_json() for d in [m.config, *m.maps.values(), *m.chunks, *m.files.values()]],
        "chain": layers,
        "logical_bytes": logical,
        "stored_bytes": stored,
        "dedup_ratio": round(logical / stored, 2) if stored else None,
        "components": component_bytes(
            chain, cfg, lambda link, role: store.image_map(link.manifest, role, str(key))
        ),
    }
