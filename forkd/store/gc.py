"""Garbage collection of a store: every blob and cached image no tag reaches is removed,
except a cached image some running process maps (a VM of a since-removed tag)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from forkd.store.blobs import clear_in_flight
from forkd.store.tags import flock

if TYPE_CHECKING:
    from forkd.store.store import Store


def reachable(store: Store) -> set[str]:
    """Digests of every manifest and blob some tag's chain references."""
    found: set[str] = set()
    for name, head in store.tags.read().items():
        for link in store.chain(head, name):
            found.add(link.digest)
            found.update(d.digest for d in link.manifest.blobs())
    return found


def collect(store: Store, on_remove: Callable[[str, int], None] | None = None) -> tuple[int, int]:
    """Remove what no tag reaches; returns (blobs, bytes) removed."""
    with flock(store.gc_lock, exclusive=True):
        keep = reachable(store)
        count = freed = 0
        for digest in list(store.blobs.digests()):
            if digest not in keep:
                size = store.blobs.size(digest)
                store.blobs.delete(digest)
                count, freed = count + 1, freed + size
                if on_remove:
                    on_remove(digest, size)
        in_use = mapped_dirs(store.cache_dir)
        for entry in store.cache_dir.iterdir():
            if entry in in_use:
                continue  # a running VM maps this image (its tag may be gone): keep it
            if entry.name.startswith(".") or f"sha256:{entry.name}" not in keep:
                shutil.rmtree(entry, ignore_errors=True)
        store.checked.prune(keep)
        clear_in_flight(store.blobs)  # no writer of this store runs while we hold the lock
        store.forget_manifests()
        return count, freed


def mapped_dirs(root: Path) -> set[Path]:
    """Directories directly under ``root`` holding a file some process maps (/proc/*/maps)."""
    prefix = str(root.resolve()) + "/"
    found: set[Path] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for line in text.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(prefix):
                found.add(root / path[len(prefix) :].split("/", 1)[0])
    return found
