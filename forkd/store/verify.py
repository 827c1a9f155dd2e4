"""Everything in the store re-read and checked: each blob's digest, each tag's chain,
configs and maps, and that every blob a manifest names is there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forkd import digest as dg
from forkd.errors import ForkdError

if TYPE_CHECKING:
    from forkd.store.store import Store


def problems(store: Store) -> list[str]:
    """What is wrong, one line each; empty when the store is sound."""
    found: list[str] = []
    for digest in store.blobs.digests():
        try:
            with store.blobs.open(digest) as f:
                dg.check(digest, dg.of_file(f), f"blob {digest}")
        except ForkdError as exc:
            found.append(str(exc))
    for name, head in sorted(store.tags.read().items()):
        try:
            for i, link in enumerate(store.chain(head, name)):
                store.config(link.digest)
                for role in link.manifest.maps:
                    store.image_map(link.manifest, role, f"{name} layer {i}")
                for d in link.manifest.blobs():
                    if not store.blobs.has(d.digest):
                        found.append(f"{name} layer {i}: blob {d.digest} is missing")
        except ForkdError as exc:
            found.append(f"{name}: {exc}")
    return found
