"""A snapshot's access order on the hub (forkd.pack.accessorder): published next to the
pack by the lazy server that recorded it, found through the referrers API by the next
lazy fork of the same snapshot on any host. Both are best effort: without it (an older
hub, no push right, none recorded yet) the prefetch goes in image order."""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from forkd import digest as dg
from forkd.errors import ForkdError, IntegrityError
from forkd.pack import accessorder as ao
from forkd.pack import mediatypes as mt
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Descriptor
from forkd.registry.client import RegistryClient, json_answer
from forkd.store.store import Store

log = logging.getLogger("forkd.lazy")
# working sets of one snapshot looked at, newest first: a hub listing thousands (each
# cut from another order) costs a lazy fork that many manifest fetches otherwise
MAX_WORKING_SETS = 8


def publish(client: RegistryClient, repo: str, head: str, order: bytes,
            working_set: WorkingSet | None = None) -> str:
    """Push ``order`` as the access-order artifact of manifest ``head`` (and, when given,
    ``working_set`` as its working-set artifact); the order artifact's digest."""
    data, _ = client.get_manifest(repo, head)
    subject = Descriptor(mt.OCI_MANIFEST, head, len(data))
    for blob in (ao.EMPTY_CONFIG, order):
        d = dg.of_bytes(blob)
        if not client.has_blob(repo, d):
            client.put_blob(repo, d, len(blob), _reader(blob))
    manifest = ao.artifact(subject, order)
    pushed = client.put_manifest(repo, dg.of_bytes(manifest), manifest)
    if working_set is not None:
        held = working_set.descriptor
        if not client.has_blob(repo, held.digest):
            client.put_blob(repo, held.digest, held.size, working_set.read)
        manifest = ao.working_set_artifact(subject, dg.of_bytes(order), held)
        client.put_manifest(repo, dg.of_bytes(manifest), manifest)
    return pushed


class WorkingSet:
    """The working-set blob of ``chunks`` (a store's chunks, in order): their stored bytes
    concatenated (accessorder, "working set"), read from the store piece by piece as an
    upload asks for them."""

    def __init__(self, store: Store, chunks: list[str]) -> None:
        self.store = store
        self.chunks = chunks
        self.starts: list[int] = []
        at = 0
        for digest in chunks:
            self.starts.append(at)
            at += store.blobs.size(digest)
        whole = dg.of_chunks(self._chunk(d) for d in chunks)
        self.descriptor = Descriptor(ao.WORKING_SET, whole, at)
        self._last: tuple[int, bytes] = (-1, b"")

    def _chunk(self, digest: str) -> bytes:
        return self.store.blobs.read(digest, self.store.blobs.size(digest),
                                     f"working-set chunk {digest}")

    def read(self, offset: int, size: int) -> bytes:
        out = bytearray()
        i = max(bisect.bisect_right(self.starts, offset) - 1, 0)
        while len(out) < size and i < len(self.chunks):
            if self._last[0] != i:
                self._last = (i, self._chunk(self.chunks[i]))
            data = self._last[1]
            start = offset + len(out) - self.starts[i]
            out += data[start : start + size - len(out)]
            i += 1
        return bytes(out)


def _reader(blob: bytes) -> Callable[[int, int], bytes]:
    def read(offset: int, size: int) -> bytes:
        return blob[offset : offset + size]

    return read


def fetch(client: RegistryClient, repo: str, head: str,
          on_working_set: Callable[[Descriptor], object] | None = None) -> ao.Order | None:
    """The newest access order the hub lists for ``head`` (with the working set cut from
    it, when the hub has one), or None. The working sets are looked up meanwhile, and
    ``on_working_set`` hears of the one that fits as soon as the order's manifest names
    it, before the order's own blob is fetched (a fork starts streaming it then)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="working-sets") as pool:
        candidates = pool.submit(_working_sets, client, repo, head)
        try:
            found = _referrers(client, repo, head, ao.ACCESS_ORDER_ARTIFACT)
            if not found:
                return None
            digest = found[-1]
            data, _ = client.get_manifest(repo, digest)
            if len(data) > MAX_MANIFEST_BYTES:
                return None
            layer = ao.order_layer(data, f"access order {digest}")
        except ForkdError as exc:
            log.info("no access order for %s from the hub: %s", head, exc)
            return None
        working_set = _fitting(client, repo, candidates.result(), layer.digest)
        if working_set is not None and on_working_set is not None:
            on_working_set(working_set)
        try:
            blob = _blob(client, repo, layer, f"access order {layer.digest}")
            order = ao.decode(blob, head, f"access order {layer.digest}")
        except ForkdError as exc:
            log.info("no access order for %s from the hub: %s", head, exc)
            return None
    return ao.Order(order.chunks, order.windows, working_set)


def _working_sets(client: RegistryClient, repo: str, head: str
                  ) -> list[tuple[str, bytes | None]]:
    """The working sets the hub lists for ``head``, newest first (``MAX_WORKING_SETS`` at
    most), the newest's manifest fetched already (the others only if it was cut from
    another order); [] when the hub has none or cannot say."""
    try:
        listed = _referrers(client, repo, head, ao.WORKING_SET_ARTIFACT)
        digests = list(reversed(listed))[:MAX_WORKING_SETS]
        if not digests:
            return []
        data, _ = client.get_manifest(repo, digests[0])
    except ForkdError as exc:
        log.info("no working set for %s from the hub: %s", head, exc)
        return []
    return [(digests[0], data), *((d, None) for d in digests[1:])]


def _fitting(client: RegistryClient, repo: str, candidates: list[tuple[str, bytes | None]],
             order_digest: str) -> Descriptor | None:
    """The first of ``candidates`` cut from that order, or None."""
    try:
        for digest, data in candidates:
            if data is None:
                data, _ = client.get_manifest(repo, digest)
            if len(data) > MAX_MANIFEST_BYTES:
                continue
            with contextlib.suppress(IntegrityError):  # cut from another order
                return ao.working_set_layer(data, order_digest, f"working set {digest}")
    except ForkdError as exc:
        log.info("no working set from the hub: %s", exc)
    return None


def _referrers(client: RegistryClient, repo: str, head: str, artifact_type: str) -> list[str]:
    """The digests of ``head``'s referrers of ``artifact_type``, oldest first."""
    resp = client.request("GET", f"/v2/{repo}/referrers/{head}", client.pull_scope(repo),
                          params={"artifactType": artifact_type})
    index = json_answer(resp, f"referrers of {head}")
    return [dg.validate(str(m.get("digest", ""))) for m in index.get("manifests") or []
            if isinstance(m, dict) and m.get("artifactType") == artifact_type]


def _blob(client: RegistryClient, repo: str, layer: Descriptor, what: str) -> bytes:
    parts: list[bytes] = []

    def sink(blocks: Iterator[bytes]) -> None:
        parts.extend(blocks)

    client.get_blob(repo, layer.digest, layer.size, layer.size, sink)
    blob = b"".join(parts)
    dg.check(layer.digest, dg.of_bytes(blob), what)
    return blob
