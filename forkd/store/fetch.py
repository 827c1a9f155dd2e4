"""Bringing a chain into the store from somewhere else (a pack file, a registry), verified.

``fetch_chain`` walks a chain head-first, asks a fetcher for the blobs the
store lacks (manifests, configs, maps, files, then every chunk of a layer in
one batch so a fetcher can run them in parallel), and checks everything: each
blob's sha256 and size as the store writes it, each manifest, config and map's
structure, and each chunk's uncompressed blake3 after a bounded decompression.
Nothing is tagged here: callers tag only after this returns.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from forkd import digest as dg
from forkd.errors import ForkdError, IntegrityError
from forkd.pack.chain import MAX_CHAIN_DEPTH, Link, walk
from forkd.pack.chunking import unpack_chunk
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import ChunkRef, check_map_size
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Manifest
from forkd.store.blobs import free_space, room
from forkd.store.store import MAX_FILE_BLOB, Store

# bytes a fetch leaves free on the store's filesystem (what else writes there: the tag
# index, a build's records, the next fetch's in-flight blobs)
ROOM_RESERVE = 64 << 20


class NoRoom(ForkdError):
    """The store's filesystem cannot take what a chain's descriptors say it weighs."""


def check_room(store: Store, need: int, what: str, where: Path | None = None) -> None:
    """NoRoom, before a byte of it is fetched, when ``need`` bytes (what ``what``'s
    descriptors declare the store lacks) would leave less than ROOM_RESERVE free where the
    store keeps its blobs (or in directory ``where``: an assembled image's): a pack, honest
    or not, that cannot fit is refused whole rather than filling the disk the host's VMs
    and store live on, then failing."""
    free = room(store.blobs) if where is None else free_space(where)
    if free is not None:
        check_free(free, need, what, where or store.home)


def check_free(free: int, need: int, what: str, where: Path) -> None:
    """NoRoom when ``need`` bytes would leave less than ROOM_RESERVE of the ``free`` bytes
    of the filesystem of ``where`` (a directory of the store)."""
    if need > free - ROOM_RESERVE:
        raise NoRoom(
            f"{what} needs {_mib(need)} in the store and {where} has {_mib(free)} free "
            f"(keeping {_mib(ROOM_RESERVE)}); free space (`forkd gc`, `forkd rmi`), or use a "
            "store on a larger filesystem (FORKD_HOME)")


def _mib(size: int) -> str:
    return f"{size / (1 << 20):,.1f} MiB"


@dataclass(frozen=True)
class Want:
    """A blob to fetch: its digest, its exact size when known, else a limit, and what it is."""

    digest: str
    size: int | None
    limit: int
    what: str
    kind: str = "blob"  # "manifest" or "blob": registries serve them from different routes


Fetcher = Callable[[list[Want]], None]


def fetch_chain(store: Store, head: str, name: str, fetch: Fetcher) -> list[Link]:
    """Fetch and verify the chain of ``head``; returns it (head first)."""

    def need(wants: list[Want]) -> None:
        missing = [w for w in wants if not store.blobs.has(w.digest)]
        if missing:
            unique = {w.digest: w.limit if w.size is None else w.size for w in missing}
            check_room(store, sum(unique.values()), name)
            fetch(missing)

    def load(digest: str) -> Manifest:
        need([Want(digest, None, MAX_MANIFEST_BYTES, f"{name} manifest {digest}", "manifest")])
        return store.manifest(digest)

    chain = walk(head, load, MAX_CHAIN_DEPTH, name)
    for i, link in enumerate(chain):
        what = f"{name} layer {i} ({dg.short(link.digest)})"
        m = link.manifest
        for role, d in m.maps.items():  # refused before a byte of it is fetched
            check_map_size(d.size, f"{what} {role} map")
        need(
            [Want(m.config.digest, m.config.size, m.config.size, f"{what} config")]
            + [Want(d.digest, d.size, MAX_FILE_BLOB, f"{what} {r}") for r, d in m.files.items()]
            + [Want(d.digest, d.size, d.size, f"{what} {r} map") for r, d in m.maps.items()]
        )
        SnapshotConfig.from_bytes(
            store.blobs.read(m.config.digest, m.config.size, f"{what} config"), f"{what} config"
        )
        for role in m.files:
            if store.blobs.size(m.files[role].digest) != m.files[role].size:
                raise IntegrityError(f"{what} {role}: size differs from its descriptor")
        chunks: list[tuple[ChunkRef, str]] = []
        for role in m.maps:
            imap = store.image_map(m, role, what)
            assert imap is not None
            chunks.extend((c, f"{what} {role} chunk {c.digest}") for c in imap.chunks)
        need([Want(c.digest, c.stored, c.stored, w) for c, w in chunks])

        def verify(item: tuple[ChunkRef, str]) -> None:
            c, w = item
            if store.checked.has(c):
                return  # decoded to what this map says before (forkd.store.checks)
            unpack_chunk(store.blobs.read(c.digest, c.stored, w), c, w)
            store.checked.add(c)

        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(verify, chunks))
    return chain
