"""Push a chain to a registry and pull one into the store: only missing blobs, in parallel.

Push goes ancestors first: each layer's missing blobs (a HEAD tells), then its
manifest by digest; the head's manifest last, by tag. A manifest refused with
``MANIFEST_BLOB_UNKNOWN`` (a blob unlinked or garbage-collected between its HEAD and
the manifest) has those blobs pushed again, once, and is sent again. Pull fetches the head
manifest by tag, then lets ``fetch_chain`` ask for whatever the store lacks
(manifests by digest through ``subject``, blobs in per-layer batches), all
verified, and tags the head only at the end. Re-running either after an
interruption skips what already arrived.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

from forkd.errors import Conflict, IntegrityError
from forkd.names import parse_ref
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Descriptor
from forkd.registry.client import RegistryClient, RegistryError
from forkd.registry.reference import RemoteRef
from forkd.store.fetch import Want, fetch_chain
from forkd.store.store import Store

Progress = Callable[[int], None]
WORKERS = 8


@dataclass(frozen=True)
class TransferResult:
    ref: str
    digest: str
    layers: int
    blobs_sent: int  # or fetched
    bytes_sent: int  # or fetched
    blobs_skipped: int


def _read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def push(
    store: Store,
    local: str,
    remote: RemoteRef,
    client: RegistryClient,
    progress: Progress | None = None,
    workers: int = WORKERS,
) -> TransferResult:
    head = store.resolve(local)
    chain = store.chain(head, str(parse_ref(local)))
    repo = remote.name
    sent = skipped = sent_bytes = 0

    def send(d: Descriptor) -> int:
        with store.blobs.open(d.digest) as f:  # any blob backend
            client.put_blob(repo, d.digest, d.size, lambda off, n: _read_at(f, off, n))
        return d.size

    def upload(d: Descriptor) -> int:
        send(d)
        if progress:
            progress(d.size)
        return d.size

    with ThreadPoolExecutor(max_workers=workers) as pool:

        def missing_of(blobs: list[Descriptor]) -> list[Descriptor]:
            present = list(pool.map(lambda d: client.has_blob(repo, d.digest), blobs))
            return [d for d, have in zip(blobs, present, strict=True) if not have]

        def put_manifest(reference: str, data: bytes, blobs: list[Descriptor]) -> int:
            """PUT the manifest; after MANIFEST_BLOB_UNKNOWN (a blob unlinked or collected
            since its HEAD) push the blobs it names and those a HEAD misses, once, and PUT
            again. Returns the bytes of blobs pushed again."""
            try:
                client.put_manifest(repo, reference, data)
                return 0
            except RegistryError as exc:
                if "MANIFEST_BLOB_UNKNOWN" not in exc.codes:
                    raise
                said = " ".join((str(exc), *exc.details))
                gone = {d.digest for d in blobs if d.digest in said}
                gone |= {d.digest for d in missing_of(blobs)}
                if not gone:
                    raise
            again = [d for d in blobs if d.digest in gone]
            resent = sum(pool.map(send, again))
            client.put_manifest(repo, reference, data)
            return resent

        for i, link in enumerate(reversed(chain)):
            blobs = link.manifest.blobs()
            missing = missing_of(blobs)
            for d in blobs:
                if d not in missing and progress:
                    progress(d.size)
            sent_bytes += sum(pool.map(upload, missing))
            sent, skipped = sent + len(missing), skipped + len(blobs) - len(missing)
            data = store.blobs.read(link.digest, MAX_MANIFEST_BYTES, "manifest")
            is_head = i == len(chain) - 1
            sent_bytes += put_manifest(remote.tag if is_head else link.digest, data, blobs)
            sent_bytes += len(data)
    return TransferResult(str(remote), head, len(chain), sent, sent_bytes, skipped)


def pull(
    store: Store,
    remote: RemoteRef,
    client: RegistryClient,
    local: str | None = None,
    progress: Progress | None = None,
    workers: int = WORKERS,
    force: bool = False,
) -> TransferResult:
    """Pull ``remote`` with its whole chain; tag it locally as ``local`` (default NAME:TAG).

    A local tag that already points at other content is kept (Conflict, checked before
    any blob travels and again when tagging) unless ``force``; re-pulling the same
    content is a no-op."""
    repo = remote.name
    target = parse_ref(local or f"{remote.name}:{remote.tag}")
    fetched = [0, 0]  # blobs, bytes
    lock = threading.Lock()

    def fetch_one(want: Want) -> None:
        try:
            if want.kind == "manifest":
                data, _ = client.get_manifest(repo, want.digest)
                store.blobs.put_bytes(data, want.digest)
                size = len(data)
            else:

                def sink(blocks: Iterator[bytes]) -> None:
                    store.blobs.put_stream(blocks, want.digest, want.size)

                client.get_blob(repo, want.digest, want.size, want.limit, sink)
                size = want.size or store.blobs.size(want.digest)
        except IntegrityError as exc:
            raise IntegrityError(f"{remote}: {want.what}: {exc}") from exc
        with lock:
            fetched[0] += 1
            fetched[1] += size
        if progress:
            progress(size)

    with ThreadPoolExecutor(max_workers=workers) as pool, store.writing():
        data, head = client.get_manifest(repo, remote.tag)
        if not force and store.tags.read().get(str(target), head) != head:
            raise Conflict(
                f"tag {target} exists with other content; pick another local tag (--tag) "
                "or pass --force to replace it"
            )
        store.blobs.put_bytes(data, head)

        def fetch(wants: list[Want]) -> None:
            list(pool.map(fetch_one, wants))

        chain = fetch_chain(store, head, str(remote), fetch)
        store.tag(str(target), head, force=force)  # refuses a tag set meanwhile to other content
    total_blobs = sum(len(link.manifest.blobs()) + 1 for link in chain)
    return TransferResult(
        str(target), head, len(chain), fetched[0], fetched[1], total_blobs - fetched[0]
    )
