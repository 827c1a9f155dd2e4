"""A snapshot's access order on the hub (forkd.pack.accessorder): published next to the
pack by the lazy server that recorded it, found through the referrers API by the next
lazy fork of the same snapshot on any host. Both are best effort: without it (an older
hub, no push right, none recorded yet) the prefetch goes in image order."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from forkd import digest as dg
from forkd.errors import ForkdError
from forkd.pack import accessorder as ao
from forkd.pack import mediatypes as mt
from forkd.pack.manifest import MAX_MANIFEST_BYTES, Descriptor
from forkd.registry.client import RegistryClient, json_answer

log = logging.getLogger("forkd.lazy")


def publish(client: RegistryClient, repo: str, head: str, order: bytes) -> str:
    """Push ``order`` as the access-order artifact of manifest ``head``; its digest."""
    data, _ = client.get_manifest(repo, head)
    subject = Descriptor(mt.OCI_MANIFEST, head, len(data))
    for blob in (ao.EMPTY_CONFIG, order):
        d = dg.of_bytes(blob)
        if not client.has_blob(repo, d):
            client.put_blob(repo, d, len(blob), _reader(blob))
    manifest = ao.artifact(subject, order)
    return client.put_manifest(repo, dg.of_bytes(manifest), manifest)


def _reader(blob: bytes) -> Callable[[int, int], bytes]:
    def read(offset: int, size: int) -> bytes:
        return blob[offset : offset + size]

    return read


def fetch(client: RegistryClient, repo: str, head: str) -> list[str] | None:
    """The newest access order the hub lists for ``head``, or None."""
    try:
        resp = client.request("GET", f"/v2/{repo}/referrers/{head}", client.pull_scope(repo),
                              params={"artifactType": ao.ACCESS_ORDER_ARTIFACT})
        index = json_answer(resp, f"referrers of {head}")
        found = [m for m in index.get("manifests") or []
                 if isinstance(m, dict) and m.get("artifactType") == ao.ACCESS_ORDER_ARTIFACT]
        if not found:
            return None
        digest = dg.validate(str(found[-1].get("digest", "")))
        data, _ = client.get_manifest(repo, digest)
        if len(data) > MAX_MANIFEST_BYTES:
            return None
        layer = ao.order_layer(data, f"access order {digest}")
        parts: list[bytes] = []

        def sink(blocks: Iterator[bytes]) -> None:
            parts.extend(blocks)

        client.get_blob(repo, layer.digest, layer.size, layer.size, sink)
        blob = b"".join(parts)
        dg.check(layer.digest, dg.of_bytes(blob), f"access order {layer.digest}")
        return ao.decode(blob, head, f"access order {layer.digest}")
    except ForkdError as exc:
        log.info("no access order for %s from the hub: %s", head, exc)
        return None
