"""The chunks of one chain, wherever they are: ``ChunkSource.read(digest)`` gives a chunk's
uncompressed bytes from the local store when it has them, else from the hub.

A chunk from the hub is checked before anything uses it: its size and sha256 against the
map (``forkd.digest``), a bounded decompression, its blake3; only then is it stored (the
blob store publishes atomically) and served. A chunk that fails is neither stored nor
served: the read raises ``IntegrityError`` naming the chunk. A chunk that is not local
while the hub cannot be reached raises ``ChunkUnavailable`` naming the chunk and the hub.
Concurrent reads of one chunk fetch it once; decompressed chunks are kept in a small LRU
(``cached_chunks``) because readers (FUSE, NBD) ask in pieces far smaller than a chunk.
A fetched chunk is decompressed and checked once, and served before it is on disk: the
store write (with its fsyncs) runs on a writer thread, off the faulting reader's path; up
to ``MAX_UNSTORED`` bytes of verified chunks wait for it (beyond that a fetch writes
inline: a store's fsyncs, a few ms a chunk, must not pace a working set's stream), and
``flush`` waits for them (before the chain is called complete, before the server exits).

``claim`` / ``arrived`` / ``unclaim`` let the working set's one request (workingset.py)
bring chunks that readers then wait for, each checked as above before anything uses it.

``open_local`` builds a source on a chain the store has; ``open_remote`` resolves a
chain from the hub's manifests first (manifests, configs, maps and the whole-file blobs
are fetched into the store, verified; chunks are not).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from forkd import digest as dg
from forkd.errors import ForkdError, IntegrityError, NotFound
from forkd.pack.chain import MAX_CHAIN_DEPTH, Link, walk
from forkd.pack.chunking import unpack_chunk
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import ChunkRef, check_map_size
from forkd.pack.manifest import Manifest
from forkd.registry.client import RegistryClient, RegistryError
from forkd.registry.reference import RemoteRef
from forkd.store.assembly import chain_maps
from forkd.store.blobs import BlobBackendError
from forkd.store.fetch import check_room
from forkd.store.imports import MAX_FILE_BLOB
from forkd.store.manifests import chain_files
from forkd.store.store import Store

RESOLVE_WORKERS = 4  # blobs a resolution fetches at once (open_remote)
CACHED_CHUNKS = 16  # decompressed chunks kept in memory: 16 x 2 MiB
MAX_UNSTORED = 64 << 20  # bytes of verified fetched chunks waiting for the store writer
WRITES_HELD_MAX = 30.0  # seconds ``hold_writes`` can hold the store writer at most


class _LeftToReaders(Exception):
    """A chunk the working set's stream claimed but did not bring (it stopped first): its
    waiting readers fetch it themselves."""


class ChunkUnavailable(ForkdError):
    """A chunk is not in the local store and the hub cannot serve it."""

    exit_code = 7


@dataclass(frozen=True)
class Hub:
    """Where missing chunks come from: a registry client and the repository of the chain."""

    client: RegistryClient
    repo: str

    def __str__(self) -> str:
        return f"{self.client.hub}/{self.repo}"


class ChunkSource:
    """Verified uncompressed chunks of ``chain`` (head first); thread-safe."""

    def __init__(self, store: Store, chain: list[Link], name: str, hub: Hub | None = None,
                 cached_chunks: int = CACHED_CHUNKS) -> None:
        self.store = store
        self.chain = chain
        self.name = name
        self.hub = hub
        self.head = chain[0].digest
        self.config = store.config(self.head)
        self.refs: dict[str, tuple[ChunkRef, str]] = {}  # digest → (ref, what), oldest last
        for role in ("memory", "disk"):
            if not any(role in link.manifest.maps for link in chain):
                continue
            for imap in chain_maps(store, chain, role, name):
                for c in imap.chunks:
                    known = self.refs.setdefault(c.digest, (c, f"{name}: {role} chunk "
                                                               f"{c.digest}"))[0]
                    if known.blob != c.blob:  # one digest, two contents: which to serve?
                        raise IntegrityError(
                            f"{name}: its maps name chunk {c.digest} twice with different "
                            f"sizes or content hashes ({known.size}/{known.stored} bytes "
                            f"and {c.size}/{c.stored}); the pack is corrupt or hostile: "
                            "ask its publisher to push it again")
        self.fetched_bytes = 0  # compressed bytes that came from the hub
        self.fetched_chunks = 0
        self.decoded = 0  # chunks decompressed and checked (a chunk read twice may count twice)
        self._checked: set[str] = set()  # chunks whose content this source has checked
        self._cached_chunks = cached_chunks
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._inflight: dict[str, Future[bytes]] = {}
        self._pinned: dict[str, bytes] = {}  # decoded, kept until unpin (being handed on)
        self._lock = threading.Lock()
        self._unstored: dict[str, bytes] = {}  # verified, fetched, not yet in the store
        self._unstored_bytes = 0
        self._store_errors: list[str] = []
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-store")
        self._writes_open = threading.Event()  # closed: the writer holds what it is given
        self._writes_open.set()
        self._closed = False  # close() was called: the server stops

    # -- queries -----------------------------------------------------------
    def ref(self, digest: str) -> ChunkRef:
        try:
            return self.refs[digest][0]
        except KeyError:
            raise NotFound(f"{self.name}: no chunk {digest} in its chain") from None

    def has(self, digest: str) -> bool:
        """Whether the chunk is in the local store (no fetch needed)."""
        return self.store.blobs.has(digest)

    def available(self, digest: str) -> bool:
        """Whether reading the chunk needs no fetch (decoded, waiting for the store, or in
        it)."""
        with self._lock:
            if digest in self._cache or digest in self._pinned:
                return True
        return self.local(digest)

    def local(self, digest: str) -> bool:
        """Whether the chunk is here, in the store or on its way to it (no fetch needed)."""
        with self._lock:
            if digest in self._unstored:
                return True
        return self.has(digest)

    def missing(self) -> list[str]:
        """The chain's chunks the local store does not have yet."""
        return [d for d in self.refs if not self.store.blobs.has(d)]

    # -- reads -------------------------------------------------------------
    def read(self, digest: str, keep: bool = True) -> bytes:
        """The chunk's uncompressed bytes, verified (module docstring); keep False: not
        kept in the LRU of decompressed chunks (a prefetch must not evict readers').
        ChunkUnavailable once closed (its server stops: the prefetch ends there)."""
        with self._lock:
            if self._closed:
                raise ChunkUnavailable(f"{self.name}: its lazy server stopped (no child "
                                       "reads it any more); a later lazy fork goes on")
            data = self._cache.get(digest)
            if data is not None:
                self._cache.move_to_end(digest)
                return data
            data = self._pinned.get(digest)
            if data is not None:
                return data
            pending = self._inflight.get(digest)
            mine = pending is None
            if pending is None:
                pending = Future()
                self._inflight[digest] = pending
        if not mine:
            try:
                return pending.result()
            except _LeftToReaders:  # the working set's stream stopped before it: fetch it
                return self.read(digest, keep)
        try:
            data = self._load(digest)
        except BaseException as exc:
            with self._lock:
                del self._inflight[digest]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[digest]
            if keep:
                self._remember(digest, data)
        pending.set_result(data)
        return data

    def _remember(self, digest: str, data: bytes) -> None:
        """Keep decoded ``data`` in the LRU (under the lock)."""
        self._cache[digest] = data
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cached_chunks:
            self._cache.popitem(last=False)

    def ensure(self, digest: str) -> bool:
        """Bring the chunk into the local store without decompressing it for a reader;
        True when it had to be fetched (prefetch). A chunk on its way to the store counts
        as there (``flush`` waits for it)."""
        if self.local(digest):
            return False
        self.read(digest, keep=False)
        return True

    def fetch_files(self, roles: tuple[str, ...] = ("vmstate", "kernel", "initrd")) -> int:
        """The chain's whole-file blobs of ``roles`` into the store, verified; the bytes
        fetched."""
        fetched = fetch_files(self.store, self.hub, self.chain, self.name, roles)
        with self._lock:
            self.fetched_bytes += fetched
        return fetched

    def hold_writes(self) -> None:
        """Keep fetched chunks in memory (up to MAX_UNSTORED bytes) until ``open_writes``:
        a lazy server's first children start meanwhile, and on a small host the store's
        hashing and fsyncs take the cores their start needs. They are served all the same."""
        self._writes_open.clear()

    def open_writes(self) -> None:
        """Let the store writer write what it holds, and what comes."""
        self._writes_open.set()

    def flush(self) -> None:
        """Wait until every fetched chunk is in the store; a failed store write raises
        (the chunk is not in the store: it is fetched again when next needed)."""
        self.open_writes()
        self._writer.submit(lambda: None).result()  # one writer: it runs after the rest
        with self._lock:
            errors, self._store_errors = self._store_errors, []
        if errors:
            raise ForkdError(f"{self.name}: {len(errors)} fetched chunks could not be stored: "
                             f"{errors[0]}; check the store's disk")

    def close(self) -> None:
        """Flush, then stop the store writer. Reads end here: a fetch still on its way
        when it closes is not stored."""
        with self._lock:
            self._closed = True
        try:
            self.flush()
        finally:
            self._writer.shutdown(wait=True)

    def complete(self) -> bool:
        """Every blob of the chain is in the local store (it can be tagged)."""
        return all(self.store.blobs.has(d.digest) for link in self.chain
                   for d in link.manifest.blobs())

    def _load(self, digest: str) -> bytes:
        ref, what = self.refs.get(digest) or (None, "")
        if ref is None:
            raise NotFound(f"{self.name}: no chunk {digest} in its chain")
        with self._lock:
            blob = self._unstored.get(digest)
            self.decoded += 1
        if blob is None:
            try:
                blob = self.store.blobs.read(digest, ref.stored, what)
            except NotFound:
                data = self._fetch(ref, what)  # verified, decompressed
                self._note_checked(digest)
                return data
            except BlobBackendError:
                raise
        data = unpack_chunk(blob, ref, what)
        self._note_checked(digest)
        return data

    def _note_checked(self, digest: str) -> None:
        """Its content checked: by this source, and in the store's record
        (``forkd.store.checks``), so no later pull or lazy server decodes it to check it."""
        with self._lock:
            self._checked.add(digest)
        self.store.checked.add(self.refs[digest][0])

    def unchecked(self) -> list[str]:
        """The chain's chunks whose content neither this source nor the store's record has
        checked: what reached the store by its digest alone (``fetch_into_store`` in the
        fork command, a pull killed before its check, another store user) and no reader
        has read since."""
        with self._lock:
            left = [d for d in self.refs if d not in self._checked]
        return [d for d in left if not self.store.checked.has(self.refs[d][0])]

    def check(self, digest: str) -> None:
        """Check a chunk's content (bounded decompression, blake3) as a read would, without
        keeping it: IntegrityError naming the chunk when it fails (``complete`` must not
        call a chain with such a chunk whole)."""
        if digest not in self._checked and not self.store.checked.has(self.refs[digest][0]):
            self.read(digest, keep=False)

    def fetch_into_store(self, digest: str) -> bool:
        """Bring a chunk that is not here into the store without decompressing it (streamed
        in, its size and digest checked as the store writes it; its content is checked when
        it is read): what a lazy fork does for the recorded working set while its server is
        still starting. True when it was fetched."""
        if self.local(digest):
            return False
        ref, what = self.refs.get(digest) or (None, "")
        if ref is None:
            raise NotFound(f"{self.name}: no chunk {digest} in its chain")
        if self.hub is None:
            raise ChunkUnavailable(f"{what} is not in the local store and there is no hub to "
                                   "fetch it from; pull the pack again")
        with self.store.writing():
            _fetch_blob(self.store, self.hub.client, self.hub.repo, digest, ref.stored, what)
        with self._lock:
            self.fetched_bytes += ref.stored
            self.fetched_chunks += 1
        return True

    # -- claims: a working set's stream (workingset.py) brings these chunks -----
    def claim(self, digests: list[str]) -> dict[str, Future[bytes]]:
        """Claim the chunks of ``digests`` that are not here, nor decoded, nor on their
        way: a reader of one waits for ``arrived`` (or, after ``unclaim``, fetches it
        itself). The claims made."""
        here = {d for d in digests if self.has(d)}
        with self._lock:
            claims: dict[str, Future[bytes]] = {
                d: Future() for d in digests if d not in here and d not in self._cache
                and d not in self._pinned and d not in self._inflight
                and d not in self._unstored}
            self._inflight.update(claims)
        return claims

    def arrived(self, digest: str, blob: bytes, pin: bool = False) -> bytes:
        """A claimed chunk's stored bytes: checked (digest, size, content) as a fetched
        chunk is, handed to the store writer and to the readers waiting for it; its
        uncompressed bytes, which later readers get without decoding it again: kept in
        the LRU, or with ``pin`` until ``unpin`` (while the caller hands them on: a
        page-cache push, which readers of its pages may overtake). A chunk that fails
        raises and stays claimed (``unclaim``)."""
        ref, what = self.refs[digest]
        if len(blob) != ref.stored:
            raise IntegrityError(f"{what}: {len(blob)} bytes, the map declares {ref.stored}")
        dg.check(digest, dg.of_bytes(blob), what)
        data = unpack_chunk(blob, ref, what)
        self._keep_fetched(digest, blob)
        self._note_checked(digest)
        with self._lock:
            self.decoded += 1
            pending = self._inflight.pop(digest)
            if pin:
                self._pinned[digest] = data
            else:
                self._remember(digest, data)
        pending.set_result(data)
        return data

    def unpin(self, digest: str) -> None:
        """Let go of a chunk ``arrived`` pinned (its readers decode it again, if any)."""
        with self._lock:
            self._pinned.pop(digest, None)

    def unclaim(self, claims: dict[str, Future[bytes]]) -> None:
        """Give up those of ``claims`` that have not arrived: their waiting readers (and
        later ones) fetch them one by one."""
        with self._lock:
            left = [(d, f) for d, f in claims.items() if self._inflight.get(d) is f]
            for d, _ in left:
                del self._inflight[d]
        for digest, pending in left:
            pending.set_exception(_LeftToReaders(digest))

    def _keep_fetched(self, digest: str, blob: bytes) -> None:
        """A fetched, verified chunk's stored bytes: counted, and to the store writer (or
        written inline when MAX_UNSTORED bytes already wait for it)."""
        with self._lock:
            self.fetched_bytes += len(blob)
            self.fetched_chunks += 1
            if digest in self._unstored or self._closed:
                return  # on its way to the store already, or the writer is stopping
            inline = self._unstored_bytes + len(blob) > MAX_UNSTORED
            if not inline:
                self._unstored[digest] = blob
                self._unstored_bytes += len(blob)
        if inline:
            self.store.blobs.put_bytes(blob, digest)
        else:
            self._writer.submit(self._store, digest, blob)

    def _fetch(self, ref: ChunkRef, what: str) -> bytes:
        """The chunk from the hub, verified and decompressed; handed to the store writer
        (written inline when MAX_UNSTORED bytes already wait for it)."""
        if self.hub is None:
            raise ChunkUnavailable(f"{what} is not in the local store and there is no hub to "
                                   "fetch it from; pull the pack again")
        parts: list[bytes] = []

        def sink(blocks: Iterator[bytes]) -> None:
            got = 0
            for block in blocks:
                got += len(block)
                if got > ref.stored:
                    raise IntegrityError(f"{what}: the hub sends more than its "
                                         f"{ref.stored} bytes; refusing it")
                parts.append(block)

        try:
            self.hub.client.get_blob(self.hub.repo, ref.digest, ref.stored, ref.stored, sink)
        except RegistryError as exc:
            raise ChunkUnavailable(
                f"{what} is not in the local store and the hub {self.hub} cannot serve it "
                f"({exc}); bring the hub back or pull the pack while it is reachable") from exc
        blob = b"".join(parts)
        if len(blob) != ref.stored:
            raise IntegrityError(f"{what}: the hub sent {len(blob)} bytes, the map declares "
                                 f"{ref.stored}; refusing it")
        dg.check(ref.digest, dg.of_bytes(blob), f"{what} from {self.hub}")
        data = unpack_chunk(blob, ref, what)  # the content must check out before it is kept
        self._keep_fetched(ref.digest, blob)
        return data

    def _store(self, digest: str, blob: bytes) -> None:
        """The store writer: one verified chunk into the store."""
        if not self._writes_open.wait(WRITES_HELD_MAX):
            self._writes_open.set()  # nobody opened them: a held write is not a lost one
        try:
            self.store.blobs.put_bytes(blob, digest)
        except (ForkdError, OSError) as exc:
            with self._lock:
                self._store_errors.append(f"{digest}: {exc}")
        finally:
            with self._lock:
                self._unstored_bytes -= len(self._unstored.pop(digest, b""))



# ---------------------------------------------------------------- opening a chain
def open_local(store: Store, ref: str) -> ChunkSource:
    """A source on the chain of local tag ``ref`` (no hub: every chunk must be local)."""
    head = store.resolve(ref)
    return ChunkSource(store, store.chain(head, ref), ref)


def open_remote(store: Store, remote: RemoteRef, client: RegistryClient,
                head_manifest: tuple[bytes, str] | None = None) -> ChunkSource:
    """Resolve ``remote``'s chain from the hub's manifests into the store (manifests,
    configs, maps and whole-file blobs, each verified as the store writes it), and a source
    whose missing chunks come from that hub; ``head_manifest``: its tag's manifest and
    digest, fetched already (``client.get_manifest``). Nothing is tagged: the chain's
    chunks are not all local yet (the prefetch tags it once they are)."""
    repo = remote.name
    name = str(remote)
    with store.writing():
        data, head = head_manifest or client.get_manifest(repo, remote.tag)
        store.blobs.put_bytes(data, head)

        def load(digest: str) -> Manifest:
            if not store.blobs.has(digest):
                raw, _ = client.get_manifest(repo, digest)  # checked against the digest
                store.blobs.put_bytes(raw, digest)
            return store.manifest(digest)

        chain = walk(head, load, MAX_CHAIN_DEPTH, name)
        hub = Hub(client, repo)
        # the layers' maps and configs, and the device state a restore needs (kernel and
        # initrd can wait), at once: each is one round trip to the hub
        with ThreadPoolExecutor(max_workers=RESOLVE_WORKERS,
                                thread_name_prefix="resolve") as pool:
            files = pool.submit(fetch_files, store, hub, chain, name, ("vmstate",))
            blobs = []
            for i, link in enumerate(chain):
                what = f"{name} layer {i} ({dg.short(link.digest)})"
                m = link.manifest
                for role, d in m.maps.items():
                    check_map_size(d.size, f"{what} {role} map")
                    blobs.append(pool.submit(_fetch_blob, store, client, repo, d.digest,
                                             d.size, f"{what} {role} map"))
                blobs.append(pool.submit(_fetch_blob, store, client, repo, m.config.digest,
                                         m.config.size, f"{what} config"))
            for job in blobs:
                job.result()
            fetched = files.result()
        for i, link in enumerate(chain):
            what = f"{name} layer {i} ({dg.short(link.digest)}) config"
            config = link.manifest.config
            SnapshotConfig.from_bytes(store.blobs.read(config.digest, config.size, what), what)
    source = ChunkSource(store, chain, name, hub)
    # what the children's faults and the prefetch will bring into the store, refused now
    # when it cannot fit rather than when the disk is full under running children
    unfetched = {d.digest: d.size for d in chain_files(chain).values()
                 if not store.blobs.has(d.digest)}
    check_room(store, sum(source.ref(d).stored for d in source.missing())
               + sum(unfetched.values()), name)
    source.fetched_bytes += fetched
    return source


def fetch_files(store: Store, hub: Hub | None, chain: list[Link], name: str,
                roles: tuple[str, ...]) -> int:
    """The whole-file blobs of ``roles`` of ``chain`` (named ``name``) that the store lacks,
    from ``hub`` into the store, verified; the bytes fetched."""
    fetched = 0
    for role, d in chain_files(chain).items():
        if role not in roles or store.blobs.has(d.digest):
            continue
        if hub is None:
            raise ChunkUnavailable(f"{name}: its {role} blob {d.digest} is not in the "
                                   "local store and there is no hub to fetch it from")
        if d.size > MAX_FILE_BLOB:
            raise IntegrityError(f"{name}: its {role} blob is {d.size} bytes, over "
                                 f"the limit of {MAX_FILE_BLOB}")
        try:
            with store.writing():
                _fetch_blob(store, hub.client, hub.repo, d.digest, d.size, f"{name} {role}")
        except RegistryError as exc:
            raise ChunkUnavailable(f"{name}: its {role} blob {d.digest} is not in the "
                                   f"local store and the hub {hub} cannot serve it "
                                   f"({exc})") from exc
        fetched += d.size
    return fetched


def _fetch_blob(store: Store, client: RegistryClient, repo: str, digest: str, size: int,
                what: str) -> None:
    """One whole blob from the hub into the store (its size and digest checked as it is
    written; a mismatch is never published)."""
    if store.blobs.has(digest):
        return

    def sink(blocks: Iterator[bytes]) -> None:
        store.blobs.put_stream(blocks, digest, size)

    try:
        client.get_blob(repo, digest, size, size, sink)
    except IntegrityError as exc:
        raise IntegrityError(f"{what}: {exc}") from exc

